"""The daemon's own import rules (docs/architecture.md, "The daemon's walk").

Read statically, as ``test_layers`` reads the sides (``TYPE_CHECKING`` imports and imports
inside functions included):

- what every API family shares (the job, the field checks, the deadline, the cost, the
  served model, the admission step) lives in ``server/core/``, and no family stands on
  another: nothing under ``modelpool.server`` imports the OpenAI family
  (``modelpool.server.openai``) but that family itself and the app's wiring;
- ``server/core/`` imports no API family and not the app, so that any family can use it.
"""

from __future__ import annotations

from test_layers import MODULES, _imports, _in

OPENAI = "modelpool.server.openai"
CORE = "modelpool.server.core"
# The app's wiring: the one module that puts the OpenAI family's routes on the app.
WIRING = ("modelpool.server.app",)
FAMILIES = (
    OPENAI,
    "modelpool.server.responses",
    "modelpool.server.anthropic",
    "modelpool.server.ollama",
    "modelpool.server.tokenize",
    "modelpool.server.embeddings",
    "modelpool.server.rerank",
    "modelpool.server.pooling_routes",
)


def _server_modules() -> list[str]:
    return [module for module in MODULES if _in(module, ["modelpool.server"])]


def test_the_named_packages_are_real() -> None:
    modules = _server_modules()
    for name in (OPENAI, CORE, *WIRING, *FAMILIES):
        assert name in modules, name


def test_only_the_openai_family_and_the_wiring_import_it() -> None:
    arrows = [
        f"{module} -> {name}"
        for module in _server_modules()
        if not _in(module, [OPENAI, *WIRING])
        for name in _imports(module, type_checking=True)
        if _in(name, [OPENAI])
    ]
    assert not arrows, "a family-neutral thing is still in the OpenAI family: " + str(arrows)


def test_the_core_imports_no_family_and_not_the_app() -> None:
    arrows = [
        f"{module} -> {name}"
        for module in _server_modules()
        if _in(module, [CORE])
        for name in _imports(module, type_checking=True)
        if _in(name, [*FAMILIES, *WIRING, "modelpool.server.state"])
    ]
    assert not arrows
