"""Backends for the reliability regressions (importable by workers: tests/ is on sys.path)."""

from __future__ import annotations

import logging
import os
from typing import Any

from modelpool.protocol import Call


class _Forking:
    """``fork-and-log``: forks a child that logs a line (through whatever logging the
    worker has), waits for it, then logs a line of its own."""

    def generate(self, call: Call) -> str:
        child = os.fork()
        if child == 0:
            logging.getLogger("forked-helper").warning("HELPER-LINE from the forked child")
            os._exit(0)
        os.waitpid(child, 0)
        logging.getLogger("backend").warning("WORKER-LINE from the worker")
        return "forked"


def forking(model: str = "", device: str = "cpu", **options: Any) -> _Forking:
    return _Forking()
