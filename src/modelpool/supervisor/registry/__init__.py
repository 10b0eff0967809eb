"""Several :class:`~modelpool.ModelPool` s by name in one process, loaded on demand,
unloaded when idle, swapped within a measured memory budget, every load and unload a
supervised step (``core``: :class:`ModelRegistry` and its supervisor thread; ``budget``:
what must be evicted before a load; ``records``: its configuration, stats and records)::

    registry = ModelRegistry(RegistryConfig.from_server(models, server_config)).start()
    with registry.use("coder", deadline_s=30) as pool:
        print(pool.generate("def fib(n):").text)
"""

from modelpool.supervisor.registry.core import ModelLease, ModelRegistry
from modelpool.supervisor.registry.records import (
    MODEL_STATES,
    ModelState,
    ModelStats,
    RegistryConfig,
    RegistryStats,
    parse_keep_alive,
)

__all__ = [
    "MODEL_STATES",
    "ModelLease",
    "ModelRegistry",
    "ModelState",
    "ModelStats",
    "RegistryConfig",
    "RegistryStats",
    "parse_keep_alive",
]
