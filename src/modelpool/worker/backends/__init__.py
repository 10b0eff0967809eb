"""Backends, by name: ``"hf"`` is :func:`modelpool.worker.backends.hf.load`, ``"llama_cpp"``
:func:`modelpool.worker.backends.llama_cpp.load` (GGUF models on llama.cpp), ``"testing"`` the
fault-injection backend in :mod:`modelpool.worker.backends.testing`; any other name is a
``"module:factory"`` string (``"module"`` alone means ``"module:load"``).

Resolving a name imports nothing; :func:`import_backend` runs in the worker.
"""

from __future__ import annotations

import importlib

from modelpool.shared.protocol import BackendFactory

BUILTIN_BACKENDS = {
    "hf": "modelpool.worker.backends.hf:load",
    "llama_cpp": "modelpool.worker.backends.llama_cpp:load",
    "testing": "modelpool.worker.backends.testing:load",
}


def resolve_backend(name: str) -> str:
    """``"hf"`` -> ``"modelpool.worker.backends.hf:load"``; a ``module:factory`` string is kept."""
    target = BUILTIN_BACKENDS.get(name, name)
    return target if ":" in target else f"{target}:load"


def import_backend(name: str) -> BackendFactory:
    module_name, _, attribute = resolve_backend(name).partition(":")
    factory: BackendFactory = getattr(importlib.import_module(module_name), attribute)
    return factory
