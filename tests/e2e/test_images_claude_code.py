"""Claude Code reads a PNG file in a session of several turns (issue 55): a picture in an
agent's session must not break that turn nor any later one.

Claude Code itself (installed with npm by ``scripts/agents_check.install``, skipped when
npm cannot install it) against a daemon whose testing backend reads images
(``vision: True``: it answers "image 1: 64x48 PNG" for the file it decoded). The first
turn mentions the file (``@shot.png``: Claude Code sends it as an ``image`` block); the
second, ``--continue``, sends the whole session again, the image included, and must be
answered too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from images_support import encoded

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from agents_check import install, run_claude, serve  # noqa: E402

TURN_TIMEOUT_S = 180.0


@pytest.mark.slow
def test_claude_code_reads_a_png_across_turns(tmp_path: Path) -> None:
    try:
        bin_dir = install(Path.home() / ".cache" / "modelpool" / "agents")
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"npm cannot install Claude Code here: {exc}")
    work = tmp_path / "project"
    work.mkdir()
    (work / "shot.png").write_bytes(encoded(64, 48))
    daemon = serve(tmp_path / "daemon", backend_options={"vision": True})
    try:
        first = run_claude(bin_dir, daemon, work, TURN_TIMEOUT_S, prompt="describe @shot.png")
        assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
        assert "image 1: 64x48 PNG" in first.stdout, first.stdout[-2000:]
        second = run_claude(
            bin_dir, daemon, work, TURN_TIMEOUT_S, "--continue", prompt="and now say hi"
        )
        assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
        # The session's image is sent again and read again, beside the new turn's text.
        assert second.stdout.startswith("image 1: 64x48 PNG\n"), second.stdout[-2000:]
        assert "and now say hi" in second.stdout
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]
