"""The sides of ``src/modelpool`` and their import rules (docs/architecture.md, "Layers").

Read from the source, statically: every ``import`` and ``from ... import`` of a module,
inside functions too, so that a lazy import cannot hide an arrow. Every module lives in one
side (a package): ``shared/`` (both sides speak it), ``scheduling/`` (the rules),
``worker/`` (a worker process: its loop and the backends), ``supervisor/`` (the pool, its
dispatcher and the registry) and the server side (``server/``, the command, the Ray app).
The rules:

- the shared modules import nothing of the other sides, not even for types;
- the scheduling rules import only the shared modules (they read views, not records);
- the worker side imports nothing of the supervisor side or the server, at run time,
  however indirectly (a worker process loads only what it serves with), nor names them
  for types: the supervisor stands above the worker, which it starts and whose backends'
  option tables it reads before a worker exists;
- no backend imports another backend (``worker/backends/hf/`` and ``llama_cpp/`` share
  only what lies beside them in ``worker/backends/``), and the shared part imports none;
- the server imports the pool, never the reverse: nothing outside the server side imports
  ``modelpool.server``, not even for types;
- imports go one way: no module imports itself back through others, ``TYPE_CHECKING``
  imports included.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import modelpool
from modelpool.worker.backends import BUILTIN_BACKENDS

SOURCE = Path(modelpool.__file__).resolve().parent.parent

# Above the pool: the daemon, the command that starts it, the Ray Serve app.
SERVER_SIDE = ("modelpool.server", "modelpool.cli", "modelpool.ray_serve")
# The supervisor: the pool, its dispatcher thread, what watches its workers, the registry.
SUPERVISOR_SIDE = ("modelpool.supervisor",)
# A worker process: its loop and the backends it runs.
WORKER_SIDE = ("modelpool.worker",)
# What both sides speak, and the scheduling rules.
SHARED = ("modelpool.shared",)
SCHEDULING = ("modelpool.scheduling",)
# Beside the sides: the package's face, its entry point and the tiny-model builder.
TOP = ("modelpool", "modelpool.__main__", "modelpool.tinymodel", "modelpool.tinyvision")
# The packages of the built-in model backends ("modelpool.worker.backends.hf", ...).
BACKEND_PACKAGES = tuple(
    target.partition(":")[0]
    for target in BUILTIN_BACKENDS.values()
    if target.startswith("modelpool.worker.backends.")
)


def _module_files() -> dict[str, Path]:
    files = {}
    for path in (SOURCE / "modelpool").rglob("*.py"):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        files[".".join(parts).removesuffix(".__init__")] = path
    return files


MODULES = _module_files()


def _in(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def _imports(module: str, *, type_checking: bool) -> set[str]:
    """The modelpool modules ``module`` imports; ``type_checking``: with the imports under
    ``if TYPE_CHECKING:`` too."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skipped: set[int] = set()
    if not type_checking:
        for node in ast.walk(tree):
            test = getattr(node, "test", None)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(test or node):
                inner = (child for statement in node.body for child in ast.walk(statement))
                skipped.update(id(child) for child in inner)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name in MODULES and name != module}


def _closure(roots: Iterable[str]) -> dict[str, str]:
    """Every module importing ``roots`` loads at run time, each with the one that
    brought it in (parent packages included: importing a.b.c runs a and a.b)."""
    brought_by: dict[str, str] = {}
    todo = [(root, "") for root in roots]
    while todo:
        module, by = todo.pop()
        if module in brought_by:
            continue
        brought_by[module] = by
        parts = module.split(".")
        todo.extend((".".join(parts[:end]), module) for end in range(1, len(parts)))
        todo.extend((name, module) for name in _imports(module, type_checking=False))
    return brought_by


def test_the_layer_lists_name_real_modules() -> None:
    for name in (*SERVER_SIDE, *SUPERVISOR_SIDE, *WORKER_SIDE, *SHARED, *SCHEDULING, *TOP):
        assert name in MODULES, f"{name} is in a layer list but is not a module"
    assert len(BACKEND_PACKAGES) >= 2


def test_every_module_lives_in_one_side() -> None:
    sides = (SERVER_SIDE, SUPERVISOR_SIDE, WORKER_SIDE, SHARED, SCHEDULING)
    homeless = [m for m in MODULES if m not in TOP and not any(_in(m, side) for side in sides)]
    assert not homeless


def test_the_shared_modules_import_no_side() -> None:
    others = SERVER_SIDE + SUPERVISOR_SIDE + WORKER_SIDE + SCHEDULING
    arrows = [
        f"{module} -> {name}"
        for module in MODULES
        if _in(module, SHARED)
        for name in _imports(module, type_checking=True)
        if _in(name, others)
    ]
    assert not arrows


def test_the_scheduling_rules_import_only_the_shared_modules() -> None:
    """The rules read views of the records (``scheduling.views``), never the records: a
    rule is tested, and read, alone, and the worker side may use the ordering."""
    arrows = [
        f"{module} -> {name}"
        for module in MODULES
        if _in(module, SCHEDULING)
        for name in _imports(module, type_checking=True)
        if not _in(name, SHARED + SCHEDULING)
    ]
    assert not arrows


def test_the_worker_side_loads_nothing_of_the_supervisor_or_the_server() -> None:
    worker_side = [m for m in MODULES if _in(m, WORKER_SIDE)]
    loaded = _closure(worker_side)
    crossing = {
        module: by for module, by in loaded.items() if _in(module, SUPERVISOR_SIDE + SERVER_SIDE)
    }
    assert not crossing, f"worker-side modules load (module: imported by) {crossing}"


def test_the_worker_side_names_nothing_of_the_supervisor_even_for_types() -> None:
    arrows = [
        f"{module} -> {name}"
        for module in MODULES
        if _in(module, WORKER_SIDE)
        for name in _imports(module, type_checking=True)
        if _in(name, SUPERVISOR_SIDE + SERVER_SIDE)
    ]
    assert not arrows


def test_no_backend_imports_another_backend() -> None:
    arrows = []
    for module in MODULES:
        if not _in(module, ["modelpool.worker.backends"]):
            continue
        own = [package for package in BACKEND_PACKAGES if _in(module, [package])]
        for name in _imports(module, type_checking=True):
            other = [package for package in BACKEND_PACKAGES if _in(name, [package])]
            if other and other != own and module != "modelpool.worker.backends":
                arrows.append(f"{module} -> {name}")
    assert not arrows


def test_only_the_server_side_imports_the_server() -> None:
    arrows = [
        f"{module} -> {name}"
        for module in MODULES
        if not _in(module, SERVER_SIDE)
        for name in _imports(module, type_checking=True)
        if _in(name, ["modelpool.server"])
    ]
    assert not arrows


def _named_imports(module: str) -> set[str]:
    """The modules ``module`` imports by name, under ``TYPE_CHECKING`` and in functions
    too: ``from a.b import c`` is ``a.b.c`` if that is a module, else ``a.b`` (not the
    packages above it, which every import runs but which are not what it reads)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def test_no_two_modules_import_each_other_however_indirectly() -> None:
    """Imports go one way (a module a cycle joins cannot be read, or loaded, alone)."""
    graph = {module: _named_imports(module) for module in MODULES}
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for name in sorted(graph[module]):
            if state.get(name) == "open":
                cycles.append([*path[path.index(name) :], module, name])
            elif name not in state:
                visit(name, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, [" -> ".join(cycle) for cycle in cycles]


def test_no_module_holds_more_than_one_concern_by_its_size() -> None:
    """A module past 800 lines holds more than one concern (docs/architecture.md, "The
    pieces"): split it by concern before it lands."""
    sizes = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    assert {module: lines for module, lines in sizes.items() if lines > 800} == {}
