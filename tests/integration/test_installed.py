"""Installed, not cloned: the built wheel works on its own, outside the checkout.

Builds the sdist and the wheel (``python -m build``: the wheel is built from the
sdist, so the sdist is proven complete), checks both with ``twine check --strict``
and reads their metadata, then installs the wheel into one fresh virtual
environment in a temporary directory with the pinned CPU torch build, and runs
every command from another temporary directory with no config file in sight:

1. the core install (no extras): ``import modelpool``, ``modelpool --version``,
   ``python -m modelpool``, ``modelpool generate`` on a local pool, and
   ``modelpool serve`` refusing with the extra it needs;
2. the same environment plus ``[server]``: ``modelpool serve`` on the testing
   backend, a real OpenAI-style request against it, ``modelpool generate --url``,
   ``modelpool config --show``.

The environment is built once for the module (installing torch is the slow part).
"""

from __future__ import annotations

import email.parser
import email.policy
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path

import httpx
import pytest
from e2e_support import BOUND_PORT

import modelpool
from helpers import skip_unless_pypi, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
PIP_TIMEOUT_S = 900
COMMAND_TIMEOUT_S = 120


@dataclass
class Artifacts:
    wheel: Path
    sdist: Path
    build_s: float


@dataclass
class Venv:
    root: Path
    workdir: Path  # an empty directory outside the checkout: every command runs here
    env: dict[str, str]
    torch_requirement: str
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def modelpool(self) -> Path:
        return self.root / "bin" / "modelpool"

    def run(
        self, *command: str | Path, timeout: float = COMMAND_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(part) for part in command],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.workdir,
            env=self.env,
        )

    def pip_install(self, *requirements: str | Path, step: str) -> None:
        started = time.monotonic()
        result = self.run(
            self.python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",  # Python compiles what it imports; torch has thousands of modules
            self.torch_requirement,  # named each time, so no resolve can swap the build
            *requirements,
            timeout=PIP_TIMEOUT_S,
        )
        self.timings[step] = time.monotonic() - started
        assert result.returncode == 0, f"pip install failed:\n{result.stderr[-4000:]}"


def _clean_env(home: Path) -> dict[str, str]:
    """This process's environment less what would point the child at the checkout."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")
        and not key.startswith("MODELPOOL_")
    }
    env["MODELPOOL_HOME"] = str(home)  # no prepared embedded model: nothing is reused
    return env


def _cpu_torch_requirement() -> str:
    """The torch build this test runs on, which must be a CPU one: ``torch==2.13.0+cpu``.

    Pinning the exact version, local label included, installs the same CPU build
    (a local file here) and never lets pip choose a CUDA build from the index."""
    version = importlib.metadata.version("torch")
    requires = importlib.metadata.requires("torch") or []
    if any(requirement.startswith("nvidia-") for requirement in requires):
        pytest.skip(f"this interpreter's torch {version} is a CUDA build; the check pins CPU")
    return f"torch=={version}"


# ---- the artifacts ---------------------------------------------------------------------------


# What a checkout holds besides its sources: never part of a build.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    ".*_cache",
    ".hypothesis",
    "bench-out",
)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    # Built from a copy, so the sdist step's egg-info never lands in the checkout.
    source = tmp_path_factory.mktemp("source") / "modelpool"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCES)
    out = tmp_path_factory.mktemp("dist")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
        check=False,
        env=_clean_env(out),
    )
    build_s = time.monotonic() - started
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    wheels = sorted(out.glob("*.whl"))
    sdists = sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(out.iterdir())
    return Artifacts(wheels[0], sdists[0], build_s)


def _metadata(text: str) -> Message:
    return email.parser.Parser(policy=email.policy.compat32).parsestr(text)


def test_twine_check_passes_on_the_wheel_and_the_sdist(artifacts: Artifacts) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", artifacts.wheel, artifacts.sdist],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_both_artifacts_carry_the_license_version_and_metadata(artifacts: Artifacts) -> None:
    version = modelpool.__version__
    assert artifacts.wheel.name == f"modelpool-{version}-py3-none-any.whl"
    assert artifacts.sdist.name == f"modelpool-{version}.tar.gz"
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text

    with zipfile.ZipFile(artifacts.wheel) as wheel:
        names = set(wheel.namelist())
        dist_info = f"modelpool-{version}.dist-info"
        wheel_metadata = _metadata(wheel.read(f"{dist_info}/METADATA").decode())
        assert wheel.read(f"{dist_info}/licenses/LICENSE").decode() == license_text
        entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert {"modelpool/__main__.py", "modelpool/py.typed", "modelpool/cli/__init__.py"} <= names
    assert "modelpool = modelpool.cli:main" in entry_points
    # No repository-only folder rides along into site-packages.
    assert not any(name.startswith(("tests/", "scripts/", "benchmarks/")) for name in names)

    with tarfile.open(artifacts.sdist) as sdist:
        root = f"modelpool-{version}"
        sdist_names = set(sdist.getnames())
        pkg_info = sdist.extractfile(f"{root}/PKG-INFO")
        license_member = sdist.extractfile(f"{root}/LICENSE")
        assert pkg_info is not None and license_member is not None
        sdist_metadata = _metadata(pkg_info.read().decode())
        assert license_member.read().decode() == license_text
    assert {f"{root}/pyproject.toml", f"{root}/README.md", f"{root}/CHANGELOG.md"} <= sdist_names

    for metadata in (wheel_metadata, sdist_metadata):
        assert metadata["Name"] == "modelpool"
        assert metadata["Version"] == version
        assert metadata["License-Expression"] == "Apache-2.0"
        assert metadata.get_all("License-File") == ["LICENSE"]
        assert metadata["Requires-Python"]
        assert metadata["Description-Content-Type"] == "text/markdown"
        urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL") or [])
        assert {"Homepage", "Source", "Issues", "Changelog"} <= set(urls)
        assert all(url.startswith("https://") for url in urls.values())
        classifiers = metadata.get_all("Classifier") or []
        assert any(c.startswith("Operating System :: ") for c in classifiers), classifiers
        extras = set(metadata.get_all("Provides-Extra") or [])
        assert {"server", "embedded"} <= extras
        requires = metadata.get_all("Requires-Dist") or []
        core = [r for r in requires if "extra ==" not in r]
        assert not any(r.startswith(("fastapi", "uvicorn", "httpx")) for r in core), core


# ---- one environment, outside the checkout ---------------------------------------------------


@pytest.fixture(scope="module")
def venv(artifacts: Artifacts, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh virtual environment with the core wheel (no extras) and the CPU torch."""
    skip_unless_pypi("installing the wheel and its dependencies")
    torch_requirement = _cpu_torch_requirement()
    base = tmp_path_factory.mktemp("installed")
    workdir = base / "somewhere-else"
    workdir.mkdir()
    env = _clean_env(base / "modelpool-home")
    started = time.monotonic()
    created = subprocess.run(
        [sys.executable, "-m", "venv", str(base / "venv")],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
        env=env,
    )
    assert created.returncode == 0, created.stderr
    installed = Venv(base / "venv", workdir, env, torch_requirement)
    installed.timings["venv"] = time.monotonic() - started
    installed.pip_install(artifacts.wheel, step="core wheel + torch")
    return installed


@dataclass
class CoreRun:
    """What the core install did, recorded before the server extra is added to it."""

    results: dict[str, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def core_run(venv: Venv) -> CoreRun:
    results = {
        "import": venv.run(
            venv.python,
            "-c",
            "import modelpool, importlib.util as u\n"
            "from modelpool import ModelPool, PoolConfig, PoolError\n"
            "print(modelpool.__version__)\n"
            "print(modelpool.__file__)\n"
            "print(u.find_spec('fastapi') is None and u.find_spec('uvicorn') is None)\n",
        ),
        "torch": venv.run(
            venv.python,
            "-c",
            "import torch, importlib.metadata as m\n"
            "print(torch.version.cuda)\n"
            "print(sorted(d.metadata['Name'] for d in m.distributions()"
            " if d.metadata['Name'].lower().startswith('nvidia-')))\n",
        ),
        "version": venv.run(venv.modelpool, "--version"),
        "python -m": venv.run(venv.python, "-m", "modelpool", "--version"),
        "generate": venv.run(
            venv.modelpool,
            "generate",
            "--backend",
            "testing",
            "--model",
            "none",
            "--workers",
            "1",
            "--devices",
            "cpu",
            "echo:installed and answering",
        ),
        "serve": venv.run(venv.modelpool, "serve", "--backend", "testing", "--model", "none"),
    }
    return CoreRun(results)


def test_the_core_install_imports_without_the_server_extra(venv: Venv, core_run: CoreRun) -> None:
    result = core_run.results["import"]
    assert result.returncode == 0, result.stderr
    version, location, extras_absent = result.stdout.split("\n")[:3]
    assert version == modelpool.__version__
    assert Path(location).is_relative_to(venv.root), location  # the wheel's copy, not ours
    assert not Path(location).is_relative_to(REPO)
    assert extras_absent == "True"

    torch_check = core_run.results["torch"]
    assert torch_check.returncode == 0, torch_check.stderr
    cuda, nvidia = torch_check.stdout.split("\n")[:2]
    assert cuda == "None", "a CUDA torch build was installed"
    assert nvidia in ("[]", "['nvidia-ml-py']"), nvidia


def test_version_and_python_dash_m_from_anywhere(core_run: CoreRun) -> None:
    for name in ("version", "python -m"):
        result = core_run.results[name]
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"modelpool {modelpool.__version__}"


def test_generate_runs_a_local_pool_on_the_core_install(core_run: CoreRun) -> None:
    result = core_run.results["generate"]
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "installed and answering"
    assert "worker pid" in lines[1]


def test_serve_without_the_server_extra_says_which_extra(core_run: CoreRun) -> None:
    result = core_run.results["serve"]
    assert result.returncode == 1
    assert "pip install 'modelpool[server]'" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


# ---- plus the server extra -------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_server(venv: Venv, core_run: CoreRun, artifacts: Artifacts) -> Venv:
    venv.pip_install(f"{artifacts.wheel}[server]", step="server extra")
    return venv


@pytest.fixture
def installed_daemon(with_server: Venv) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    log_path = with_server.workdir / "daemon.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                str(with_server.modelpool),
                "serve",
                "--backend",
                "testing",
                "--model",
                "none",
                "--workers",
                "1",
                "--devices",
                "cpu",
                "--port",
                "0",  # the bound port is read back from the log: no port race
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=with_server.workdir,
            env=with_server.env,
        )
    try:

        def bound_port() -> int | None:
            assert process.poll() is None, f"daemon exited:\n{log_path.read_text()[-3000:]}"
            found = BOUND_PORT.search(log_path.read_text())
            return int(found.group(1)) if found else None

        port = wait_until(bound_port, COMMAND_TIMEOUT_S, interval=0.05, message="the bound port")
        url = f"http://127.0.0.1:{port}"
        # The port opens once the pool is ready.
        assert httpx.get(url + "/readyz", timeout=10.0).status_code == 200
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
    assert process.returncode == 0, log_path.read_text()[-3000:]


def test_serve_with_no_config_answers_a_real_request(
    with_server: Venv, installed_daemon: tuple[str, subprocess.Popen[str]]
) -> None:
    url, _ = installed_daemon
    assert list(with_server.workdir.iterdir()) == [with_server.workdir / "daemon.log"]
    response = httpx.post(
        url + "/v1/chat/completions",
        json={"model": "any", "messages": [{"role": "user", "content": "echo:from a wheel"}]},
        timeout=30.0,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "from a wheel"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["none"]

    remote = with_server.run(with_server.modelpool, "generate", "--url", url, "echo:via the cli")
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout.splitlines()[0] == "via the cli"


def test_config_show_reports_the_built_in_defaults(with_server: Venv) -> None:
    result = with_server.run(with_server.modelpool, "config", "--show")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert 'model = "embedded:smollm2-135m-instruct"  # built-in' in lines
    assert 'host = "127.0.0.1"  # built-in' in lines
    assert "port = 8000  # built-in" in lines
    missing = with_server.run(with_server.modelpool, "serve", "--config", "configs/default.toml")
    assert missing.returncode == 1
    assert "config file not found: configs/default.toml" in missing.stderr
