"""scripts/build-llama-server, without compiling: a built binary is reused, a missing tool
is named. (The compile itself, about 20 minutes, is what benchmarks.llama_cpp runs.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-llama-server"
BASH = shutil.which("bash") or "/bin/bash"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bash scripts")


def run_script(cache: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MODELPOOL_LLAMA_SERVER_DIR": str(cache), "PATH": path}
    return subprocess.run(
        [BASH, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_a_built_binary_is_printed_and_not_rebuilt(tmp_path: Path) -> None:
    binary = tmp_path / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    done = run_script(tmp_path, os.environ.get("PATH", ""))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(binary)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["build"], "nothing fetched"


def test_a_missing_compiler_tool_is_named_before_anything_is_fetched(tmp_path: Path) -> None:
    # A PATH with only what the script needs before its check: no cmake, no compiler.
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("dirname",):
        found = shutil.which(name)
        assert found is not None
        (tools / name).symlink_to(found)
    cache = tmp_path / "cache"
    done = run_script(cache, str(tools))
    assert done.returncode == 2
    assert "needs cmake" in done.stderr
    assert not cache.exists(), "nothing fetched or built"
