"""The backends' own layout rules: the hf runner is apart from the hf handler, and
resolving a backend name imports nothing. That no backend imports another, nor the
shared ``backends.common`` any backend, is tests/unit/test_layers.py's."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import modelpool.worker.backends

BACKENDS = Path(modelpool.worker.backends.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at any level (TYPE_CHECKING blocks included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_hf_runner_does_not_import_the_handler() -> None:
    names = imported_modules(BACKENDS / "hf" / "runner.py")
    assert not any(name.startswith("modelpool.worker.backends.hf.handler") for name in names)


def test_resolving_a_backend_name_imports_no_backend() -> None:
    code = (
        "import sys\n"
        "from modelpool.worker.backends import resolve_backend\n"
        "print(resolve_backend('hf'), resolve_backend('llama_cpp'))\n"
        "print(sorted(m for m in sys.modules if m.startswith('modelpool.worker.backends.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    targets, loaded = result.stdout.strip().splitlines()
    assert targets == "modelpool.worker.backends.hf:load modelpool.worker.backends.llama_cpp:load"
    assert loaded == "[]"
