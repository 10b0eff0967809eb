"""The backends' import rules: each backend package imports the shared one
(``backends.common``), never another backend; the shared one imports no backend; the
hf runner is apart from the hf handler; resolving a backend name imports nothing."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import modelpool.backends

BACKENDS = Path(modelpool.backends.__file__).parent
PACKAGES = ("common", "hf", "llama_cpp")


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


@pytest.mark.parametrize("package", PACKAGES)
def test_a_backend_imports_no_other_backend(package: str) -> None:
    others = [other for other in PACKAGES if other not in (package, "common")]
    for path in sorted((BACKENDS / package).glob("*.py")):
        for name in imported_modules(path):
            for other in others:
                assert not name.startswith(f"modelpool.backends.{other}"), (
                    f"{path.relative_to(BACKENDS)} imports {name}"
                )
            if package == "common":
                assert name != "modelpool.backends.hf" and name != "modelpool.backends.llama_cpp"


def test_the_hf_runner_does_not_import_the_handler() -> None:
    names = imported_modules(BACKENDS / "hf" / "runner.py")
    assert not any(name.startswith("modelpool.backends.hf.handler") for name in names)


def test_resolving_a_backend_name_imports_no_backend() -> None:
    code = (
        "import sys\n"
        "from modelpool.backends import resolve_backend\n"
        "print(resolve_backend('hf'), resolve_backend('llama_cpp'))\n"
        "print(sorted(m for m in sys.modules if m.startswith('modelpool.backends.')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    targets, loaded = result.stdout.strip().splitlines()
    assert targets == "modelpool.backends.hf:load modelpool.backends.llama_cpp:load"
    assert loaded == "[]"
