"""The Python versions the project claims agree everywhere, and the bootstrap picks its venv
by version: requires-python, the classifiers (which scripts/test-pythons runs), the
requirements lines of the README and the docs pages, and scripts/_bootstrap.sh."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def classifier_versions() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    prefix = "Programming Language :: Python :: "
    found = [c.removeprefix(prefix) for c in project["classifiers"] if c.startswith(prefix)]
    return [v for v in found if re.fullmatch(r"3\.\d+", v)]


def minor(version: str) -> int:
    return int(version.split(".")[1])


def test_classifiers_are_consecutive_from_requires_python() -> None:
    versions = classifier_versions()
    assert versions, "no 'Programming Language :: Python :: 3.X' classifier"
    minors = [minor(v) for v in versions]
    assert minors == list(range(minors[0], minors[0] + len(minors)))
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={versions[0]}"


def test_documented_requirement_lines_name_exactly_the_tested_versions() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    lines = [
        (page.relative_to(ROOT), line)
        for page in pages
        for line in page.read_text().splitlines()
        if re.search(r"with Python 3\.\d+", line, re.IGNORECASE)
    ]
    assert any(str(page) == "README.md" for page, _ in lines), (
        "no 'with Python 3.X' requirement line in the README"
    )
    for page, line in lines:
        assert re.findall(r"3\.\d+", line) == classifier_versions(), f"{page}: {line}"


def _fake_python(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {version}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A checkout's files the bootstrap reads, and python3 on PATH as 3.11."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "_bootstrap.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    _fake_python(tmp_path / "bin" / "python3", "3.11")
    return tmp_path


def select(checkout: Path, python: Path | None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{checkout / 'bin'}:/usr/bin:/bin"}
    if python is not None:
        env["PYTHON"] = str(python)
    return subprocess.run(
        [
            "bash",
            "-c",
            'source scripts/_bootstrap.sh && select_python && echo "$PY_VERSION $VENV"',
        ],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_bootstrap_reads_the_supported_versions_from_the_classifiers(checkout: Path) -> None:
    result = subprocess.run(
        ["bash", "-c", "source scripts/_bootstrap.sh && supported_pythons"],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout.split() == classifier_versions()


def test_default_python_builds_dot_venv_and_others_their_own(checkout: Path) -> None:
    default = select(checkout, None)
    assert default.stdout.split() == ["3.11", str(checkout / ".venv")], default.stderr
    other = select(checkout, _fake_python(checkout / "bin" / "python3.12", "3.12"))
    assert other.stdout.split() == ["3.12", str(checkout / ".venv-3.12")], other.stderr


def test_an_existing_venv_keeps_the_python_it_was_made_with(checkout: Path) -> None:
    _fake_python(checkout / ".venv" / "bin" / "python", "3.13")
    result = select(checkout, None)
    assert result.stdout.split() == ["3.13", str(checkout / ".venv")], result.stderr
    # python3 is now "another" version: it gets its own venv instead of replacing .venv.
    result = select(checkout, checkout / "bin" / "python3")
    assert result.stdout.split() == ["3.11", str(checkout / ".venv-3.11")], result.stderr


def test_an_unsupported_python_is_refused_with_the_supported_list(checkout: Path) -> None:
    result = select(checkout, _fake_python(checkout / "bin" / "python3.10", "3.10"))
    assert result.returncode == 2
    assert "Python 3.10" in result.stderr
    for version in classifier_versions():
        assert version in result.stderr


def test_a_python_named_by_version_is_found_under_pyenv_too(checkout: Path, tmp_path: Path) -> None:
    """PYTHON=python3.X finds $PYENV_ROOT/versions/3.X.*, as scripts/test-pythons does."""
    absent = [
        v for v in classifier_versions() if not shutil.which(f"python{v}", path="/usr/bin:/bin")
    ]
    if not absent:
        pytest.skip("every supported version is on /usr/bin here")
    version = absent[-1]
    pyenv = tmp_path / "pyenv"
    found = _fake_python(pyenv / "versions" / f"{version}.1" / "bin" / f"python{version}", version)
    result = subprocess.run(
        [
            "bash",
            "-c",
            'source scripts/_bootstrap.sh && select_python && echo "$PY_VERSION $PYTHON_FOR_VENV"',
        ],
        cwd=checkout,
        env={
            "PATH": f"{checkout / 'bin'}:/usr/bin:/bin",
            "PYENV_ROOT": str(pyenv),
            "PYTHON": f"python{version}",
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.stdout.split() == [version, str(found)], result.stderr
