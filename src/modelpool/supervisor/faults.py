"""Faults in the supervisor itself, for tests: the fault-injection backend
(:mod:`modelpool.worker.backends.testing`) rehearses a worker's; this rehearses a bug in
the dispatcher (an action that raises) or a wedged one (an action that blocks)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from modelpool.shared.errors import PoolError
from modelpool.supervisor.pool import ModelPool


def run_on_dispatcher(pool: ModelPool, action: Callable[[], None]) -> threading.Thread:
    """Test hook: run ``action`` on ``pool``'s dispatcher thread, between two of its events.

    An action that raises rehearses a bug in the dispatcher (the pool fails every
    request with ``PoolError``, kills its workers and goes "failed"); one that blocks
    rehearses a wedged dispatcher (``close()`` still kills the workers). Returns the
    dispatcher thread, so that a test can wait for it to end::

        thread = run_on_dispatcher(pool, lambda: 1 / 0)
        thread.join(10)

    Raises ``PoolError`` if the pool's dispatcher is not running.
    """
    loop = pool._loop
    if loop is None or not loop.post(action):
        raise PoolError("the pool's dispatcher is not running")
    return loop.thread
