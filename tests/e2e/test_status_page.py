"""The status page, /ui, in a real headless Chromium (docs, The status page).

A daemon with an API key kills a worker whose request hangs past its deadline; the page,
given the key in its URL fragment, shows that worker as killed and replaced (by the pid
that now serves), and a screenshot is taken. A daemon with ``[models]`` tables shows each
model's state, memory, workers and queue. Chromium is Debian's package:
``scripts/install-chromium`` installs it when it is missing (root and apt needed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from e2e_support import KEY_ENV, daemon_config, registry_config, start_daemon, wait_for

from helpers import slack

ROOT = Path(__file__).resolve().parents[2]
KEY = "status-page-key"


@pytest.fixture(scope="module")
def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        installed = subprocess.run(
            [str(ROOT / "scripts" / "install-chromium")],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        found = shutil.which("chromium")
        if found is None:
            pytest.skip(f"no chromium, and it could not be installed: {installed.stderr[-500:]}")
    return found


def _browse(
    chromium: str, profile: Path, url: str, *action: str
) -> subprocess.CompletedProcess[str]:
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1280,1200",
        # Run the page's timers and fetches for this long of its own time, then act.
        "--virtual-time-budget=6000",
        *action,
        url,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=slack(60), check=False)


def test_the_page_shows_a_killed_worker_as_replaced(chromium: str, tmp_path: Path) -> None:
    daemon = start_daemon(
        tmp_path / "daemon",
        daemon_config(workers=2, server={"api_key_env": "STATUS_PAGE_KEY"}),
        env={"STATUS_PAGE_KEY": KEY},
    )
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{daemon.url}/stats").status_code == 401, "data needs the key"
        shell = httpx.get(f"{daemon.url}/ui")
        assert shell.status_code == 200 and "modelpool status" in shell.text
        assert "default-src 'none'" in shell.headers["content-security-policy"]
        stats = httpx.get(f"{daemon.url}/stats", headers=auth).json()
        before = {worker["pid"] for worker in stats["workers"]}
        hung = httpx.post(
            f"{daemon.url}/v1/completions",
            json={"prompt": "hang", "timeout": 0.5},
            headers=auth,
            timeout=slack(30),
        )
        assert hung.status_code == 504, hung.text
        killed = hung.json()["error"]["attempts"][0]["worker_pid"]

        def settled() -> dict[str, object]:
            return httpx.get(f"{daemon.url}/stats", headers=auth).json()  # type: ignore[no-any-return]

        stats = wait_for(
            settled,
            lambda s: (
                any(e["kind"] == "release" for e in s["recent_events"])
                and sum(w["state"] == "idle" for w in s["workers"]) == 2
            ),
            timeout=slack(20),
            what="the killed worker replaced",
        )
        now = {worker["pid"] for worker in stats["workers"]}
        assert killed in before and killed not in now
        (replacement,) = now - before

        url = f"{daemon.url}/ui#key={KEY}"
        dom = _browse(chromium, tmp_path / "profile-dom", url, "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        page = dom.stdout
        assert f"pid {killed}" in page and "timeout (SIGTERM)" in page
        assert f"replaced by pid {replacement}" in page
        assert "memory released" in page
        assert KEY not in page, "the key does not stay in the page"
        screenshot = tmp_path / "status.png"
        shot = _browse(chromium, tmp_path / "profile-shot", url, f"--screenshot={screenshot}")
        assert shot.returncode == 0, shot.stderr[-2000:]
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert screenshot.stat().st_size > 20_000, "a page, not a blank image"
        artifacts = os.environ.get("MODELPOOL_TEST_ARTIFACTS")
        if artifacts:  # kept for a person to look at (CI uploads the folder)
            shutil.copy(screenshot, Path(artifacts) / "status-page.png")
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]


def test_the_page_shows_each_model_of_a_models_daemon(chromium: str, tmp_path: Path) -> None:
    models = {
        "chat": {"model": "chat-weights", "preload": True, "workers": 2},
        "emb": {"model": "emb-weights", "preload": True, "backend_options": {"task": "embed"}},
        "spare": {"model": "spare-weights"},
    }
    config = registry_config(models, workers=1, server={})
    daemon = start_daemon(tmp_path / "daemon", config, env={KEY_ENV: KEY})
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        answer = httpx.post(
            f"{daemon.url}/v1/completions",
            json={"model": "chat", "prompt": "echo:x"},
            headers=auth,
            timeout=slack(30),
        )
        assert answer.status_code == 200, answer.text
        dom = _browse(chromium, tmp_path / "profile", f"{daemon.url}/ui#key={KEY}", "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        page = dom.stdout
        assert "unreachable" not in page and "NaN" not in page
        assert 'class="badge ready"' in page
        rows = _rows(page, "models")
        states = [row[:2] for row in rows]
        assert states == [["chat", "loaded"], ["emb", "loaded"], ["spare", "unloaded"]]
        chat = rows[0]
        assert int(chat[2]) > 0, "its memory in MB"
        assert chat[3:6] == ["2 / 2", "0", "0"], "workers ready, queued, running"
        workers = [row[0] for row in _rows(page, "workers")]
        assert workers == ["chat / 0", "chat / 1", "emb / 0"]
    finally:
        assert daemon.stop() == 0, daemon.log()[-4000:]


def _rows(page: str, body_id: str) -> list[list[str]]:
    """The cells of the rows of ``<tbody id=body_id>`` in a dumped DOM."""
    body = page.split(f'<tbody id="{body_id}">', 1)[1].split("</tbody>", 1)[0]
    return [
        [cell.rsplit(">", 1)[1] for cell in row.split("</td>")[:-1]]
        for row in body.split("</tr>")[:-1]
    ]
