"""examples/ run as a user runs them: the embedded chat model, asked with chat messages.

Each example is a file the README points at; running it here keeps it working as
written (the README's own blocks are checked by tests/unit/test_readme.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import REPO, Daemon, prepare_embedded_model, start_daemon

from helpers import toml_value

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
# "auto" finds no GPU with this: an example runs the same on every host.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def embedded_model() -> Path:
    return prepare_embedded_model()


def run_example(name: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, **NO_GPU, **(env or {})},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_library_example_answers_with_the_chat_template(embedded_model: Path) -> None:
    lines = run_example("library.py").splitlines()
    assert "Paris" in lines[0], lines  # asked with chat messages: an answer
    assert lines[1].endswith(" s"), lines
    assert "Paris" in lines[2], lines  # streamed
    assert lines[3] == " Paris", lines  # a string, continued as raw text
    assert lines[4] == lines[0], lines  # asyncio, greedy: the same answer


@pytest.fixture(scope="module")
def embedded_daemon(
    embedded_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    config = "\n".join(
        f"{key} = {toml_value(value)}"
        for key, value in {
            "model": "embedded:smollm2-135m-instruct",
            "workers": 1,
            "spares": 0,
            "devices": ["cpu"],
        }.items()
    )
    daemon = start_daemon(
        tmp_path_factory.mktemp("examples"),
        config + "\n",
        env={"MODELPOOL_API_KEY": "example-key"},
        ready_timeout=300.0,
    )
    yield daemon
    assert daemon.stop() == 0, daemon.log()[-4000:]


def test_openai_client_example_against_the_daemon(embedded_daemon: Daemon) -> None:
    output = run_example(
        "openai_client.py",
        {"MODELPOOL_URL": embedded_daemon.url + "/v1", "MODELPOOL_API_KEY": "example-key"},
    )
    assert "Paris" in output, output
