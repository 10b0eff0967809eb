"""The short variant of ``scripts/scale-out``: 3 daemons behind haproxy on loopback,
a kubelet stand-in, a rolling restart, a SIGKILL and a SIGSTOP under load.

The script itself checks what the issue asks (no request lost in the roll, only the
faulted daemons' attempts failed and were retried, the frozen daemon left rotation
within its bound, no process left) and exits 1 on a violation; this test runs it and
reads its figures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_scale_out_short() -> None:
    if shutil.which("haproxy") is None:
        if os.environ.get("CI"):
            pytest.fail("haproxy is missing in CI: scripts/test installs it")
        pytest.skip("haproxy is not installed (scripts/scale-out installs it)")
    completed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "scale_out.py"), "--short", "--json"],
        capture_output=True,
        text=True,
        timeout=220,
        cwd=ROOT,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output[-6000:]
    summary = completed.stdout.strip().splitlines()[-1]
    assert summary.startswith("scale-out: ") and summary.endswith(": OK"), summary
    figures = json.loads(completed.stdout[: completed.stdout.rindex("}") + 1])
    assert figures["roll_failed"] == 0
    assert figures["failed_for_good"] == 0
    assert figures["leftover_processes"] == 0
    assert figures["sigstop_in_rotation_s"] <= figures["sigstop_rotation_bound_s"]
    assert figures["sigkill_workers_gone_s"] is not None
    assert figures["sigkill_workers_gone_s"] < 1.0
    assert figures["requests_under_faults"] > 0
