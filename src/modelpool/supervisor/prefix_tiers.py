"""A pool's prefix cache tiers (``shared.prefix_tier``): where they live, who owns them,
and what the supervisor reads of them.

The host tier lives in ``prefix_cache_host_dir`` when the configuration names one (its
owner keeps it: several pools, or pools one after another, may share it), else in a
directory the pool makes in ``/dev/shm`` when it starts and removes when it closes, so
that it outlives every worker of the pool but not the pool (a registry's pools are given
their model's directory, kept while the model is out: ``registry.host_tiers``). The
disk tier lives in a subdirectory of ``prefix_cache_dir`` named for the model and
backend, and is never removed. Workers get both as ``WorkerSpec.prefix_tiers``; the pool
reads the tiers' sizes, counters and fingerprints from their directories on a thread of
its own (``tier_watch``), so they cost no worker a message and count what killed workers
did.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from modelpool.shared.config import PoolConfig
from modelpool.shared.prefix_tier import TierSpec

SHARED_MEMORY = Path("/dev/shm")


def with_host_tier(config: PoolConfig) -> tuple[PoolConfig, str | None]:
    """``config`` with its host tier's directory named, and that directory if the pool
    made it (and so removes it at close)."""
    if config.prefix_cache_host_bytes <= 0 or config.prefix_cache_host_dir is not None:
        return config, None
    parent = SHARED_MEMORY if SHARED_MEMORY.is_dir() else Path(tempfile.gettempdir())
    made = tempfile.mkdtemp(prefix=f"modelpool-tier-{os.getpid()}-", dir=parent)
    return config.replace(prefix_cache_host_dir=made), made


def remove_host_tier(directory: str | None) -> None:
    """Remove a host tier the pool made (its bytes are host memory)."""
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


def tier_specs(config: PoolConfig) -> tuple[TierSpec, ...]:
    """The tiers the pool's workers write and read, host first."""
    specs = []
    if config.prefix_cache_host_bytes > 0 and config.prefix_cache_host_dir is not None:
        specs.append(TierSpec("host", config.prefix_cache_host_dir, config.prefix_cache_host_bytes))
    if config.prefix_cache_dir is not None and config.prefix_cache_dir_bytes > 0:
        name = f"{config.backend}\0{config.model}".encode()
        subdirectory = hashlib.blake2b(name, digest_size=8).hexdigest()
        directory = os.path.join(os.path.expanduser(config.prefix_cache_dir), subdirectory)
        specs.append(TierSpec("disk", directory, config.prefix_cache_dir_bytes))
    return tuple(specs)
