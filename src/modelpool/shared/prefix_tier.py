"""Prefix cache tiers: cached prefixes kept outside the workers, so that a kill, a recycle,
a model swap or a daemon restart costs the prefix's restore, not its prefill.

A :class:`PrefixTierStore` is the ordered tiers of one model: a host tier (a directory in
``/dev/shm`` that the pool creates and removes at close, so it outlives every worker but
not the pool) and, optionally, a disk tier (``prefix_cache_dir``, which outlives the
daemon). Workers write and read it; the supervisor reads its sizes and counters. Each
tier is a directory with one file per entry, bounded in bytes, least recently used out
first::

    store = PrefixTierStore.open(
        [TierSpec("host", "/dev/shm/modelpool-1234/tiny", 512 * 2**20)],
        identity=model_identity("/models/tiny", backend="hf", dtype="float32"),
    )
    store.store(ids, partition, payload, meta={"layers": ...}, fingerprints=fps)
    hit = store.lookup(prompt_ids, partition)   # TierHit | None: the longest stored prefix
    if hit is not None:
        restore(hit.payload, hit.meta); prefill(prompt_ids[hit.length:])
    store.stats()                               # one TierStats per tier

**An entry** holds the state of a token prefix: its ids, the backend's bytes (``payload``:
hf, the prefix's KV tensors as raw bytes, their shapes and dtypes in ``meta``; llama_cpp,
the sequence state of ``llama_state_seq_get_data``) and the prefix fingerprints the pool
places by. Its file is named by its *key*, a blake2b chain over its ids in
``BLOCK_TOKENS`` blocks seeded with its partition (``prefixes.partition_of``: the
request's ``cache_salt`` and adapter) and the model identity: key k names ids[:16(k+1)].
A lookup walks a prompt's keys from the longest (at most all but its last id, whose
logits choose the first token) and takes the first entry that verifies, so it finds an
entry whose whole blocks the prompt starts with: an agent's next turn starts with the
previous turn's prompt and answer.

**Crash-safe.** A writer writes a temporary file (``.tmp-<pid>-<n>``) and ``os.replace``-s
it onto the entry's name: a writer killed mid-write leaves a temporary file that no
lookup opens (it is removed once its writer is dead), never a torn entry under an
entry's name. Every read checks the header (magic, format version, the model identity,
the partition) and a CRC-32 of the ids and payload (it guards against torn and damaged
files; whoever can write the tier's directory could write a whole entry anyway, and a
cryptographic hash cost 145 ms on a 92 MB prefix against the CRC's 38), and that the
entry's ids are the prompt's prefix its key claims; an entry failing any check is never
used: it is removed and counted as ``rejected``. Eviction runs under an ``fcntl`` lock on
the tier's ``.lock`` file, which the kernel releases when its holder dies.

**Counters that outlive the workers.** Hits, misses, restores, restore seconds, stores
and rejections are kept per tier in its ``.stats`` file (updated under the lock), so a
killed worker's counts stay and the supervisor reads them without asking a worker.

**Isolation.** A partition's keys are seeded with its id, and a read checks the header's
partition too: a lookup never returns, and so ``cached_tokens`` never reveals, another
partition's entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import itertools
import json
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

TierName = Literal["host", "disk"]

BLOCK_TOKENS = 16
"""Ids per key: an entry is found by a prompt that starts with its whole blocks."""
FORMAT_VERSION = 2
MAGIC = b"MPTIER\x00\x01"
ENTRY_SUFFIX = ".kv"
_TEMP_PREFIX = ".tmp-"
_LOCK_NAME = ".lock"
_STATS_NAME = ".stats"
_HEADER_LENGTH = struct.Struct("<I")
_MAX_HEADER_BYTES = 16 * 2**20
_COUNTERS = ("hits", "misses", "restores", "restore_seconds", "stores", "rejected", "evictions")
# Beside the counters: an upper bound on the entries' bytes, so that a write which fits
# under it needs no walk of the directory (a long prefix has a name per 16-token block: a
# tier of 200 two-thousand-token entries is 25,000 names to stat, ~0.4 s a write). Each
# store adds its size; evictions, rejects and replaced names only free bytes, so the bound
# never falls below the truth. A write that would pass it, and every RECOUNT_EVERY-th
# store, walks the tier and sets it to the bytes found.
_UPPER_BOUND = "bytes_upper_bound"
RECOUNT_EVERY = 64
_writes = itertools.count()


@dataclass(frozen=True)
class TierSpec:
    """One tier: its name, directory and bound in bytes (0: the tier is off)."""

    name: TierName
    directory: str
    limit_bytes: int


@dataclass(frozen=True)
class TierHit:
    """The longest stored prefix of a prompt: its ``length`` ids (the entry's own may be
    longer: restore only ``length``), the backend's ``payload`` and ``meta``, the tier it
    came from and the prefix fingerprints stored with it."""

    tier: TierName
    length: int
    ids: tuple[int, ...]
    payload: memoryview
    meta: Mapping[str, Any]
    fingerprints: tuple[int, ...]


@dataclass(frozen=True)
class TierStats:
    """A tier's size and counters (every process's, since the tier was created)."""

    tier: TierName
    bytes: int = 0
    limit_bytes: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    restores: int = 0
    restore_seconds: float = 0.0
    stores: int = 0
    rejected: int = 0
    evictions: int = 0


@dataclass(frozen=True)
class EntryHeader:
    """An entry's partition and the prefix fingerprints stored with it."""

    partition: int
    fingerprints: tuple[int, ...]


def model_identity(
    model: str, *, backend: str, dtype: str | None, extra: Mapping[str, Any] | None = None
) -> str:
    """A stable identity of a loaded model's KV: the model's path (absolute) or name, its
    files' names, sizes and modification times (a directory, a file, or nothing for a hub
    name), the backend, the dtype, modelpool's format version and ``extra`` (anything else
    the KV depends on). A tier entry written under another identity is never used."""
    parts: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "modelpool": _modelpool_version(),
        "backend": backend,
        "dtype": dtype or "",
        "extra": dict(extra or {}),
    }
    path = Path(os.path.expanduser(model))
    if path.exists():
        parts["model"] = str(path.resolve())
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        parts["files"] = [
            [
                str(file.relative_to(path)) if path.is_dir() else file.name,
                stat.st_size,
                stat.st_mtime_ns,
            ]
            for file in files
            if file.is_file() and (stat := file.stat())
        ]
    else:
        parts["model"] = model
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _modelpool_version() -> str:
    try:
        return importlib.metadata.version("modelpool")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def entry_keys(ids: Sequence[int], partition: int, identity: str) -> list[str]:
    """The key of each whole block of ``ids``: key k names ids[: BLOCK_TOKENS * (k + 1)]
    in ``partition`` of the model ``identity`` (hex, 32 characters)."""
    previous = hashlib.blake2b(
        f"{identity}\0{partition}".encode(), digest_size=16, person=b"prefix-tier"
    ).digest()
    keys = []
    whole = len(ids) - len(ids) % BLOCK_TOKENS
    for start in range(0, whole, BLOCK_TOKENS):
        block = struct.pack(f"<{BLOCK_TOKENS}q", *ids[start : start + BLOCK_TOKENS])
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        keys.append(previous.hex())
    return keys


class PrefixTierStore:
    """The tiers of one model (host first, then disk), for a worker or the supervisor.

    Every method is safe against other processes using the same directories at once and
    against any of them being killed at any point; none raises for what it finds in a
    directory (a bad entry is rejected, an unreadable directory is a miss)."""

    def __init__(self, tiers: Sequence[_Tier], identity: str) -> None:
        self.tiers = list(tiers)
        self.identity = identity

    @classmethod
    def open(cls, specs: Sequence[TierSpec], identity: str) -> PrefixTierStore:
        """The store over ``specs`` (tiers with a bound of 0 left out), creating their
        directories."""
        return cls([_Tier(spec) for spec in specs if spec.limit_bytes > 0], identity)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def lookup(
        self, ids: Sequence[int], partition: int = 0, longer_than: int = 0
    ) -> TierHit | None:
        """The longest stored prefix of ``ids`` (at most all but the last id) in
        ``partition`` whose whole blocks reach past ``longer_than`` ids (what the worker's
        own cache holds), from the first tier that holds one; counts a hit, and a
        restore's seconds (reading and checking it), or a miss per tier asked.

        An entry whose blocks reach no further is never read: an agent's next turn on the
        worker that answered the last one finds the same prefix in the worker's memory
        and in the tiers, and reading it from the tier (a 2,000-token SmolLM2 prefix is
        92 MB) would cost more than the turn. Such a lookup counts a miss only when the
        worker held nothing either: the counters say what the tiers were needed for."""
        started = time.monotonic()
        keys = entry_keys(ids[: len(ids) - 1], partition, self.identity)
        first = longer_than // BLOCK_TOKENS  # the first block longer than the worker's
        for tier in self.tiers:
            hit = tier.lookup(ids, partition, self.identity, keys, first)
            if hit is not None:
                tier.count(hits=1, restores=1, restore_seconds=time.monotonic() - started)
                return hit
            if not longer_than:
                tier.count(misses=1)
        return None

    def store(
        self,
        ids: Sequence[int],
        partition: int,
        payload: bytes | memoryview | Sequence[bytes | memoryview],
        meta: Mapping[str, Any] | None = None,
        fingerprints: Sequence[int] = (),
    ) -> bool:
        """Keep ``payload`` (the backend's state of ``ids``; several buffers are written
        one after the other, without joining them) in every tier; True if any tier kept
        it. An entry larger than a tier's bound is not kept there; the least recently
        used entries make room. The file gets one name (a hard link) per whole block of
        ``ids``, so a prompt that shares only its first blocks finds it too; a name an
        older entry had is taken over (the new entry holds that prefix as well), and an
        entry left with no name is gone."""
        keys = entry_keys(ids, partition, self.identity)
        if not keys:
            return False
        header, body = _encode(ids, partition, self.identity, payload, meta, fingerprints)
        kept = False
        for tier in self.tiers:
            kept = tier.store(keys, header, body) or kept
        return kept

    def holds(self, ids: Sequence[int], partition: int = 0) -> bool:
        """Whether some tier already has an entry holding the whole blocks of ``ids`` (not
        read nor checked: a writer skips what is already there)."""
        keys = entry_keys(ids, partition, self.identity)
        return bool(keys) and any(tier.path(keys[-1]).exists() for tier in self.tiers)

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]


@dataclass
class _Stored:
    """An entry as a directory scan finds it: its names, size and last use (ns)."""

    paths: list[Path]
    size: int
    used_ns: int


class _Tier:
    """One directory of entries under a byte bound."""

    def __init__(self, spec: TierSpec) -> None:
        self.name = spec.name
        self.directory = Path(spec.directory)
        self.limit_bytes = spec.limit_bytes
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / (key + ENTRY_SUFFIX)

    def lookup(
        self, ids: Sequence[int], partition: int, identity: str, keys: list[str], first: int
    ) -> TierHit | None:
        """The longest entry named by one of the prompt's ``keys`` from block ``first``
        on."""
        for block in range(self._longest_named(keys, first), first - 1, -1):
            path = self.path(keys[block])
            try:
                data = _read(path)
            except OSError:
                continue
            hit = _decode(data, self.name, ids, partition, identity, BLOCK_TOKENS * (block + 1))
            if hit is None:
                self._reject(path)
                continue
            with contextlib.suppress(OSError):
                os.utime(path)  # the most recently used: the last out
            return hit
        return None

    def _longest_named(self, keys: list[str], first: int) -> int:
        """The last block of ``keys`` from ``first`` on with a name in the tier (``first``
        - 1: none), by bisection: an entry is named under each of its blocks, so the names
        a prompt finds are its first blocks (a miss is one ``stat``, not one per block). A
        name removed meanwhile only makes the hit shorter; the caller walks down from here
        past any it rejects."""
        low, high = first - 1, len(keys) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if self.path(keys[middle]).exists():
                low = middle
            else:
                high = middle - 1
        return low

    def store(self, keys: list[str], header: bytes, body: Sequence[bytes | memoryview]) -> bool:
        size = len(header) + sum(memoryview(part).nbytes for part in body)
        if size > self.limit_bytes:
            return False
        temp = self._temp_path()
        try:
            with open(temp, "wb") as file:
                file.write(header)
                for part in body:
                    file.write(part)
            with self._locked():
                counters = _read_counters(self.directory)
                bound = counters.get(_UPPER_BOUND)
                recount = int(counters.get("stores", 0.0)) % RECOUNT_EVERY == 0
                if bound is None or recount or bound + size > self.limit_bytes:
                    bound = self._make_room(size)
                # Plain strings: a long prefix is a hundred names and more, and pathlib's
                # joins cost as much as the links themselves.
                directory, written = str(self.directory), str(temp)
                for key in keys:
                    # A link to a temporary name, then renamed over the entry's name: a
                    # name always points at a whole file, old or new.
                    link = f"{directory}/{_TEMP_PREFIX}{os.getpid()}-{next(_writes)}"
                    os.link(written, link)
                    os.replace(link, f"{directory}/{key}{ENTRY_SUFFIX}")
                self._add_counts(stores=1, **{_UPPER_BOUND: bound + size})
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()
        return True

    def _temp_path(self) -> Path:
        return self.directory / f"{_TEMP_PREFIX}{os.getpid()}-{next(_writes)}"

    def count(self, **counts: float) -> None:
        with contextlib.suppress(OSError), self._locked():
            self._add_counts(**counts)

    def stats(self) -> TierStats:
        sizes = [entry.size for entry in self._entries()]
        return counted_stats(self.name, self.limit_bytes, sizes, tier_counters(self.directory))

    def _reject(self, path: Path) -> None:
        with contextlib.suppress(OSError), self._locked():
            path.unlink(missing_ok=True)
            self._add_counts(rejected=1)

    def _make_room(self, size: int) -> float:
        """Remove the least recently used entries (oldest modification first, every name
        of each) until ``size`` more bytes fit, and the temporary files of dead writers
        (under the lock); the bytes left."""
        entries = self._entries()
        total = sum(entry.size for entry in entries)
        evicted = 0
        for entry in sorted(entries, key=lambda entry: entry.used_ns):
            if total + size <= self.limit_bytes:
                break
            for path in entry.paths:
                with contextlib.suppress(OSError):
                    path.unlink()
            total -= entry.size
            evicted += 1
        for temp in self.directory.glob(_TEMP_PREFIX + "*"):
            if not _writer_alive(temp.name):
                temp.unlink(missing_ok=True)
        if evicted:
            self._add_counts(evictions=evicted)
        return float(total)

    def _entries(self) -> list[_Stored]:
        """Each entry (a file, under each of its names) with its size and last use."""
        found: dict[int, _Stored] = {}
        with contextlib.suppress(OSError), os.scandir(self.directory) as scan:
            for item in scan:
                if not item.name.endswith(ENTRY_SUFFIX):
                    continue
                with contextlib.suppress(OSError):
                    stat = item.stat()
                    entry = found.setdefault(
                        stat.st_ino, _Stored([], stat.st_size, stat.st_mtime_ns)
                    )
                    entry.paths.append(Path(item.path))
        return list(found.values())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock; the kernel does as much for a dead holder

    def _add_counts(self, **counts: float) -> None:
        """Add ``counts`` to the tier's counters (the caller holds the lock); written
        through a temporary file, so a kill leaves the old counters, not torn ones."""
        current = _read_counters(self.directory)
        for name, value in counts.items():
            if name == _UPPER_BOUND:
                current[name] = value  # set, not added: the caller computed it
            else:
                current[name] = current.get(name, 0.0) + value
        temp = self._temp_path()
        temp.write_text(json.dumps(current))
        os.replace(temp, self.directory / _STATS_NAME)


def tier_counters(directory: str | os.PathLike[str]) -> dict[str, float]:
    """A tier's counters as its ``.stats`` file holds them (zeros where it holds none)."""
    stored = _read_counters(directory)
    return {name: stored.get(name, 0.0) for name in _COUNTERS}


def _read_counters(directory: str | os.PathLike[str]) -> dict[str, float]:
    """The numbers of a tier's ``.stats`` file (counters and the bytes' upper bound); a
    missing or damaged file holds none, which makes the next write walk the tier."""
    try:
        stored = json.loads(Path(directory, _STATS_NAME).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(stored, dict):
        return {}
    return {
        name: float(value)
        for name, value in stored.items()
        if name in (*_COUNTERS, _UPPER_BOUND)
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }


def counted_stats(
    tier: TierName, limit_bytes: int, sizes: Sequence[int], counters: Mapping[str, float]
) -> TierStats:
    """A tier's stats from its entries' sizes and its counters (``tier_counters``)."""
    return TierStats(
        tier=tier,
        bytes=sum(sizes),
        limit_bytes=limit_bytes,
        entries=len(sizes),
        hits=int(counters["hits"]),
        misses=int(counters["misses"]),
        restores=int(counters["restores"]),
        restore_seconds=float(counters["restore_seconds"]),
        stores=int(counters["stores"]),
        rejected=int(counters["rejected"]),
        evictions=int(counters["evictions"]),
    )


def entry_header(path: str | os.PathLike[str]) -> EntryHeader | None:
    """What an entry's header says of its prompt (None: not an entry of this format),
    read from the header alone: the supervisor places by it and never reads a payload.
    Nothing is checked beyond the format: a worker's read checks the rest, and a header
    wrongly believed costs a placement, never an answer."""
    start = len(MAGIC) + _HEADER_LENGTH.size
    try:
        with open(path, "rb") as file:
            opening = file.read(start)
            if len(opening) != start or opening[: len(MAGIC)] != MAGIC:
                return None
            (header_length,) = _HEADER_LENGTH.unpack_from(opening, len(MAGIC))
            if header_length > _MAX_HEADER_BYTES:
                return None
            header = json.loads(file.read(header_length))
        if header["version"] != FORMAT_VERSION:
            return None
        fingerprints = tuple(int(value) for value in header["fingerprints"])
        return EntryHeader(int(header["partition"]), fingerprints)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _encode(
    ids: Sequence[int],
    partition: int,
    identity: str,
    payload: bytes | memoryview | Sequence[bytes | memoryview],
    meta: Mapping[str, Any] | None,
    fingerprints: Sequence[int],
) -> tuple[bytes, list[bytes | memoryview]]:
    """An entry's header (magic, length, JSON) and body (the ids as int64, then the
    payload's buffers); the checksum covers the body."""
    parts = [payload] if isinstance(payload, (bytes, memoryview)) else list(payload)
    id_bytes = struct.pack(f"<{len(ids)}q", *ids)
    checksum = zlib.crc32(id_bytes)
    for part in parts:
        checksum = zlib.crc32(part, checksum)
    header = json.dumps(
        {
            "version": FORMAT_VERSION,
            "identity": identity,
            "partition": partition,
            "tokens": len(ids),
            "payload_bytes": sum(memoryview(part).nbytes for part in parts),
            "checksum": f"{checksum:08x}",
            "meta": dict(meta or {}),
            "fingerprints": list(fingerprints),
        }
    ).encode()
    return MAGIC + _HEADER_LENGTH.pack(len(header)) + header, [id_bytes, *parts]


def _decode(
    data: mmap.mmap | bytes,
    tier: TierName,
    ids: Sequence[int],
    partition: int,
    identity: str,
    claimed: int,
) -> TierHit | None:
    """The hit an entry's bytes give for ``ids``, or None when any check fails: format,
    identity, partition, sizes, checksum, and the entry's first ``claimed`` ids (what its
    name says it holds) being the prompt's."""
    start = len(MAGIC) + _HEADER_LENGTH.size
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        return None
    (header_length,) = _HEADER_LENGTH.unpack_from(data, len(MAGIC))
    if header_length > _MAX_HEADER_BYTES or start + header_length > len(data):
        return None
    try:
        header = json.loads(data[start : start + header_length])
        tokens = int(header["tokens"])
        payload_bytes = int(header["payload_bytes"])
        checksum = str(header["checksum"])
        meta = dict(header["meta"])
        fingerprints = tuple(int(value) for value in header["fingerprints"])
        valid = header["version"] == FORMAT_VERSION and header["identity"] == identity
        valid = valid and header["partition"] == partition
    except (ValueError, KeyError, TypeError):
        return None
    body = memoryview(data)[start + header_length :]
    if not valid or tokens < claimed or len(body) != tokens * 8 + payload_bytes:
        return None
    if f"{zlib.crc32(body):08x}" != checksum:
        return None
    held = struct.unpack_from(f"<{tokens}q", body)
    limit = len(ids) - 1
    if tuple(ids[:claimed]) != held[:claimed]:
        return None
    length = claimed
    while length < min(tokens, limit) and held[length] == ids[length]:
        length += 1
    return TierHit(
        tier=tier,
        length=length,
        ids=held,
        payload=body[tokens * 8 :],
        meta=meta,
        fingerprints=fingerprints,
    )


def _read(path: Path) -> mmap.mmap | bytes:
    """The file's bytes, mapped copy-on-write rather than read: a backend may view its
    payload as tensors in place, and a write to them never reaches the file. Mapping
    spares the copy a read makes into fresh memory (of a 92 MB entry, ~0.19 s against
    the map's page faults as the checksum reads it); an entry's file is never written
    in place (a writer renames a new file over its name), so what is mapped stays whole."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return b""
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)


def _writer_alive(temp_name: str) -> bool:
    """Whether the process that writes temporary file ``temp_name`` still runs."""
    try:
        pid = int(temp_name[len(_TEMP_PREFIX) :].split("-", 1)[0])
    except ValueError:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
