"""The registry's host prefix cache tiers: one directory per model, kept while the model
is out, so that a model evicted for another and loaded again restores its conversations
from host memory (docs/prefix-tiers.md).

An embedded :class:`~modelpool.ModelPool` makes its own host tier and removes it when it
closes. A pool the registry makes is given the model's directory instead (made at the
model's first load; the pool never removes a directory it was given), which outlives the
pool while the registry lives: the registry removes it when it closes, or earlier when
the budget needs its bytes for a load (``Budgets.plan``: out models' tiers go before a
loaded model is evicted, least recently used first). A model whose configuration names
its own ``prefix_cache_host_dir`` keeps it; the registry makes and removes none for it.

Accounting: a loaded model's tier counts at its bound in what the model holds
(``memory``); an out model's tier counts at its measured bytes (``Entry.tier_bytes``:
no worker writes it while the model is out, so it cannot grow), and a tier being removed
counts until it is gone (``dropping``).
"""

from __future__ import annotations

import threading

from modelpool.shared.config import ModelSpec, PoolConfig
from modelpool.shared.prefix_tier import PrefixTierStore, TierSpec
from modelpool.supervisor.prefix_tiers import remove_host_tier, with_host_tier


class HostTiers:
    """The host tier directories a registry owns, by model name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._directories: dict[str, str] = {}
        # Directories taken from their models to be removed, with their bytes: counted
        # in the budget until a step has removed them.
        self.dropping: dict[str, int] = {}
        self._closed = False

    def pool_config(self, spec: ModelSpec) -> PoolConfig:
        """The configuration to make ``spec``'s pool with: its host tier in the model's
        directory (made now if it has none), or ``spec.pool`` itself where the registry
        keeps no tier (off, or a directory the configuration names)."""
        config = spec.pool
        if config.prefix_cache_host_bytes <= 0 or config.prefix_cache_host_dir is not None:
            return config
        with self._lock:
            directory = self._directories.get(spec.name)
            if directory is None and not self._closed:
                config, directory = with_host_tier(config)
                if directory is not None:
                    self._directories[spec.name] = directory
                return config
        # A registry closing makes none: the pool then makes (and removes) its own.
        return config if directory is None else config.replace(prefix_cache_host_dir=directory)

    def directory(self, name: str) -> str | None:
        with self._lock:
            return self._directories.get(name)

    def measure(self, spec: ModelSpec) -> int:
        """The bytes in ``spec``'s kept tier now (0: none); reads the directory, so it is
        called off the registry's lock."""
        directory = self.directory(spec.name)
        if directory is None:
            return 0
        bound = spec.pool.prefix_cache_host_bytes
        try:
            # The identity only checks entries, which stats never reads.
            store = PrefixTierStore.open((TierSpec("host", directory, bound),), identity="")
            return sum(tier.bytes for tier in store.stats())
        except OSError:
            return 0

    def detach(self, name: str, tier_bytes: int) -> str | None:
        """Take ``name``'s directory from it to be removed (its next load makes a new
        one); its ``tier_bytes`` count in ``dropping`` until :meth:`remove`."""
        with self._lock:
            directory = self._directories.pop(name, None)
            if directory is not None:
                self.dropping[directory] = tier_bytes
            return directory

    def dropping_bytes(self) -> int:
        with self._lock:
            return sum(self.dropping.values())

    def remove(self, directory: str) -> None:
        """Remove a detached directory (a step's thread: it deletes files)."""
        remove_host_tier(directory)
        with self._lock:
            self.dropping.pop(directory, None)

    def close(self) -> None:
        """Remove every directory (the registry closed: its pools are closed)."""
        with self._lock:
            self._closed = True
            directories = [*self._directories.values(), *self.dropping]
            self._directories.clear()
            self.dropping.clear()
        for directory in directories:
            remove_host_tier(directory)
