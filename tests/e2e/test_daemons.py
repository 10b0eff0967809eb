"""Daemons with their own settings: overload, API key, [server] settings from TOML,
--workers/--spares, the access log, SIGTERM and SIGINT drains and exit."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import (
    Daemon,
    daemon_config,
    modelpool_command,
    start_daemon,
    wait_for,
)

from helpers import FAR_DEADLINE_S, LONG, LONG_TOKENS, pid_alive, slack

# The daemons' generation default (64 tokens) would end LONG in under a second.
LONG_BODY = {"prompt": LONG, "max_tokens": LONG_TOKENS}
KEY_ENV = "MODELPOOL_E2E_KEY"
KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One worker and a queue of one; a deadline far past any test's waits (LONG_BODY)."""
    daemon = start_daemon(
        tmp_path_factory.mktemp("one-slot"),
        daemon_config(workers=1, max_queue=1, deadline_s=FAR_DEADLINE_S),
    )
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = start_daemon(
        tmp_path_factory.mktemp("keyed"),
        daemon_config(
            workers=1, server={"api_key_env": KEY_ENV}, backend_options={"env_command": True}
        ),
        env={KEY_ENV: KEY},
    )
    yield daemon
    assert daemon.stop() == 0


def hold_a_stream(
    url: str, body: dict[str, Any], started: threading.Event, release: threading.Event
) -> int:
    """Stream ``body``, signal after the first chunk, hang up once ``release`` is set (the
    disconnect cancels the request): a worker kept busy for exactly as long as a test needs."""
    body = {**body, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():  # a chunk every few ms: release is seen at once
            if line.startswith("data: "):
                started.set()
            if release.is_set():
                break
        return response.status_code


def test_overload_is_429_with_retry_after(one_slot: Daemon) -> None:
    url = one_slot.url + "/v1/completions"
    # The running request must still hold the one worker when the third arrives (else the
    # queued one starts and the third is queued, not refused): through every wait below.
    one_slot.assert_outlasts(LONG_BODY, slack(5) + slack(5.0) + 30)
    started, release = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as executor:
        running = executor.submit(hold_a_stream, one_slot.url, LONG_BODY, started, release)
        try:
            assert started.wait(slack(5)), "the long request did not start"
            queued = executor.submit(httpx.post, url, json={"prompt": "echo:queued"}, timeout=30)
            # Runs past the pool's capacity wait in the daemon (fair share between
            # clients), bounded by the pool's max_queue all the same.
            wait_for(
                one_slot.stats,
                lambda s: s["fair_share"]["waiting"] == 1,
                slack(5.0),
                "one queued",
            )
            rejected = httpx.post(url, json={"prompt": "echo:third"}, timeout=30)
        finally:
            release.set()
        assert rejected.status_code == 429, rejected.text
        assert int(rejected.headers["retry-after"]) >= 1
        assert rejected.json()["error"]["code"] == "pool_overloaded"
        assert running.result() == 200
        assert queued.result().json()["choices"][0]["text"] == "queued"
    one_slot.wait_settled(1)


def test_api_key_is_required_except_for_probes(keyed: Daemon) -> None:
    body = {"messages": [{"role": "user", "content": "echo:hi"}]}
    url = keyed.url + "/v1/chat/completions"
    missing = httpx.post(url, json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert missing.headers["www-authenticate"] == "Bearer"
    for header in (f"Bearer {KEY}x", "Bearer x", f"Basic {KEY}", KEY, f"Bearer {KEY[:-1]}"):
        assert httpx.post(url, json=body, headers={"Authorization": header}).status_code == 401
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["message"]["content"] == "hi"
    assert httpx.get(keyed.url + "/healthz").status_code == 200


def test_workers_never_see_the_api_key(keyed: Daemon) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": f"env:{KEY_ENV}"}
    answer = httpx.post(keyed.url + "/v1/completions", json=body, headers=auth)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == ""
    path = httpx.post(keyed.url + "/v1/completions", json={"prompt": "env:PATH"}, headers=auth)
    assert path.json()["choices"][0]["text"]  # the command works; the key was removed
    assert httpx.get(keyed.url + "/readyz").status_code == 200
    assert httpx.get(keyed.url + "/stats").status_code == 401
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    models = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"]
    assert (
        httpx.get(keyed.url + "/stats", headers={"Authorization": f"Bearer {KEY}"}).status_code
        == 200
    )


def test_the_cli_answered_401_says_which_variable_holds_the_key(keyed: Daemon) -> None:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    stats = [*modelpool_command(), "stats", "--url", keyed.url, "--api-key-env", KEY_ENV]
    refused = subprocess.run(stats, capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 1
    [line] = refused.stderr.splitlines()
    assert line.startswith("modelpool: HTTP 401: "), line  # then the daemon's own words
    assert line.endswith(
        f"(this sent no key: it is read from ${KEY_ENV}: set it to the daemon's key, "
        "or name another variable with --api-key-env)"
    ), line
    allowed = subprocess.run(
        [*stats, "--json"], capture_output=True, text=True, env={**env, KEY_ENV: KEY}, timeout=60
    )
    assert allowed.returncode == 0, allowed.stderr


def test_ps_and_generate_url_on_a_daemon_of_one_model(keyed: Daemon) -> None:
    env = {**os.environ, KEY_ENV: KEY}
    keyed_cli = ("--url", keyed.url, "--api-key-env", KEY_ENV)
    listed = subprocess.run(
        [*modelpool_command(), "ps", *keyed_cli, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    models = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert row["name"] == models.json()["data"][0]["id"]
    assert (row["backend"], row["state"], row["unloads"]) == ("testing", "loaded", "never")
    # Its one model, whatever it is called: no --model needed.
    answered = subprocess.run(
        [*modelpool_command(), "generate", "echo:one model", *keyed_cli],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert answered.returncode == 0, answered.stderr
    assert answered.stdout.splitlines()[0] == "one model"


def _stream_text(url: str, prompt: str) -> str:
    text: list[str] = []
    body = {"prompt": prompt, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                return "".join(text)
            if line.startswith("data: "):
                text.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    raise AssertionError(f"the stream ended without [DONE] after {''.join(text)!r}")


def post_completion(
    executor: concurrent.futures.Executor, daemon: Daemon, body: dict[str, Any]
) -> concurrent.futures.Future[httpx.Response]:
    """POST a completion in the background; the test waits for it to run (``wait_busy``)."""
    return executor.submit(httpx.post, daemon.url + "/v1/completions", json=body, timeout=60)


def test_sigterm_drains_a_long_request_then_exits_0(tmp_path: Path) -> None:
    # The drain must outlast the 2 s requests however slow the machine makes them (the
    # daemons' 10 s would not under the stress mode's slack): it costs nothing, as the
    # daemon exits once they are served.
    drain_s = FAR_DEADLINE_S
    daemon = start_daemon(tmp_path, daemon_config(server={"drain_timeout_s": drain_s}))
    body = {"prompt": "tokens:40:0.05"}
    assert daemon.request_runs_for(body) == pytest.approx(2.0), "40 tokens, not capped"
    assert drain_s > slack(2.0) + slack(5.0)
    try:
        pids = daemon.worker_pids()
        assert len(pids) == 2
        expected = "".join(f"t{i} " for i in range(40))
        with concurrent.futures.ThreadPoolExecutor(2) as executor:
            pending = post_completion(executor, daemon, body)
            streaming = executor.submit(_stream_text, daemon.url, "tokens:40:0.05")
            daemon.wait_busy(2)
            daemon.process.send_signal(signal.SIGTERM)
            response = pending.result()
            assert streaming.result() == expected
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
        assert daemon.process.wait(20) == 0, daemon.log()[-4000:]
    finally:
        daemon.stop(signal.SIGKILL)
    assert not [pid for pid in pids if pid_alive(pid)]
    # Both requests were still in flight at SIGTERM (else nothing was drained): their
    # access-log lines, written as each ends, come after the drain began.
    before, drained, after = daemon.log().partition("SIGTERM: draining")
    assert drained, daemon.log()[-4000:]
    assert "POST /v1/completions" not in before
    assert after.count("POST /v1/completions 200") == 2, after


def test_sigterm_when_idle_exits_quickly_with_no_worker_left(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, daemon_config())
    try:
        pids = daemon.worker_pids()
        started = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(20) == 0, daemon.log()[-4000:]
        elapsed = time.monotonic() - started
    finally:
        daemon.stop(signal.SIGKILL)
    assert not [pid for pid in pids if pid_alive(pid)]
    assert elapsed < slack(3.0), elapsed
    print(f"SIGTERM to exit with nothing in flight: {elapsed * 1000:.0f} ms")


def _completion_text(daemon: Daemon, stream: bool) -> tuple[int, str]:
    # Far past every (slack-scaled) bound below, so a daemon that waits for the request
    # instead of stopping fails the test (tokens:600:0.2 promised two minutes; the 64-token
    # default and the 10 s deadline ended it in 10 s).
    body = {**LONG_BODY, "stream": stream}
    with httpx.stream("POST", daemon.url + "/v1/completions", json=body, timeout=60) as response:
        return response.status_code, response.read().decode()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_second_signal_stops_at_once(tmp_path: Path, stream: bool) -> None:
    # Python 3.12+ waits for open connections when the listening server closes, so the
    # request in flight must be ended, not merely abandoned (server.DrainingServer).
    # On asyncio's own loop, what a plain modelpool[server] install runs: uvloop (which
    # the ray extra brings) never waited for connections there, and would hide the bug.
    no_uvloop = tmp_path / "no-uvloop" / "uvloop"
    no_uvloop.mkdir(parents=True)
    (no_uvloop / "__init__.py").write_text("raise ImportError('uvloop hidden by the test')\n")
    path = os.pathsep.join(filter(None, [str(no_uvloop.parent), os.environ.get("PYTHONPATH")]))
    daemon = start_daemon(
        tmp_path,
        daemon_config(deadline_s=FAR_DEADLINE_S, server={"drain_timeout_s": FAR_DEADLINE_S}),
        env={"PYTHONPATH": path},
    )
    # Still running when the second signal comes, after the waits below.
    daemon.assert_outlasts(LONG_BODY, slack(5.0) + 10.0 + slack(5.0))
    try:
        pids = daemon.worker_pids()
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            pending = executor.submit(_completion_text, daemon, stream)
            daemon.wait_busy(1)
            daemon.process.send_signal(signal.SIGTERM)
            # uvicorn is waiting for the request (its log says so) when the second signal
            # goes: the moment Python 3.12+ used to hang in (an earlier second signal
            # stops uvicorn before it waits).
            wait_for(
                daemon.log,
                lambda text: "Waiting for connections to close" in text,
                10.0,
                "uvicorn to wait for the request",
            )
            started = time.monotonic()
            daemon.process.send_signal(signal.SIGINT)
            assert daemon.process.wait(20) == 0, daemon.log()[-4000:]
            assert time.monotonic() - started < slack(5.0)
            status, text = pending.result()
        if stream and status == 200:
            # The status line went out with the first token; the stream ends with the reason.
            last_event = text.strip().split("\n\n")[-1]
            assert json.loads(last_event.removeprefix("data: "))["error"]["code"] == (
                "shutting_down"
            )
        else:
            # A stream whose first token had not come yet answers like a plain request.
            assert status == 503, text
            assert json.loads(text)["error"]["code"] == "shutting_down"
    finally:
        daemon.stop(signal.SIGKILL)
    assert not [pid for pid in pids if pid_alive(pid)]


def test_public_host_without_key_warns_and_a_failed_load_exits_1(tmp_path: Path) -> None:
    # The model never loads, so the daemon exits before it binds 0.0.0.0.
    config = tmp_path / "broken.toml"
    config.write_text(
        daemon_config(startup_failures_before_giving_up=1)
        + '\n[backend_options]\nfail_load = "on purpose"\n'
    )
    result = subprocess.run(
        [*modelpool_command(), "serve", "--config", str(config), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "MODELPOOL_API_KEY"},
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "WARNING: listening on 0.0.0.0 without an API key" in result.stderr
    assert "the pool did not start" in result.stderr
    assert "on purpose" in result.stderr


# ---- [server] settings from TOML, --workers/--spares, the access log, SIGINT first -----------


@pytest.fixture(scope="module")
def configured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Every [server] setting the README names read from TOML, and --workers/--spares
    overriding the file's workers = 2."""
    daemon = start_daemon(
        tmp_path_factory.mktemp("configured"),
        daemon_config(
            workers=2,
            # Past the 30 s a client asks for below, so that what cuts it is the cap, not
            # the deadline (a daemon may cap a client's timeout at deadline_s as well).
            deadline_s=60.0,
            server={"model_name": "promised-model", "max_request_timeout_s": 1.0},
        ),
        args=("--workers", "1", "--spares", "1"),
    )
    yield daemon
    daemon.stop(signal.SIGKILL)


def test_workers_and_spares_flags_override_the_file(configured: Daemon) -> None:
    workers = configured.wait_settled(2)["workers"]
    assert sorted(w["role"] for w in workers) == ["serving", "spare"]


def test_model_name_from_toml_is_served(configured: Daemon) -> None:
    models = configured.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["promised-model"]
    body = {"model": "anything", "prompt": "echo:x"}
    reply = httpx.post(configured.url + "/v1/completions", json=body, timeout=30)
    assert reply.json()["model"] == "promised-model"


@pytest.mark.parametrize("how", ["body", "header"])
def test_max_request_timeout_caps_what_a_client_asks_for(configured: Daemon, how: str) -> None:
    body: dict[str, Any] = dict(LONG_BODY)
    headers = {}
    if how == "body":
        body["timeout"] = 30
    else:
        headers["X-Request-Timeout"] = "30"
    # Only the 1 s cap ends it: its tokens run far past every bound here (with the 64-token
    # default they were over by themselves in 0.6 s, before the cap).
    assert configured.request_runs_for(body, headers) == 1.0
    started = time.monotonic()
    reply = httpx.post(configured.url + "/v1/completions", json=body, headers=headers, timeout=60)
    elapsed = time.monotonic() - started
    assert reply.status_code == 504, reply.text
    assert 1.0 <= elapsed < slack(3.0), elapsed  # the 1 s cap, not the 30 s asked for
    configured.wait_settled(2)


def test_access_log_line_has_every_field(configured: Daemon) -> None:
    reply = httpx.post(configured.url + "/v1/completions", json={"prompt": "pid"}, timeout=30)
    assert reply.status_code == 200
    request_id = reply.headers["x-request-id"]
    pid = reply.json()["choices"][0]["text"]
    line = wait_for(
        configured.log,
        lambda text: f"request_id={request_id} " in text,
        10.0,
        "the access-log line",
    )
    [entry] = [row for row in line.splitlines() if f"request_id={request_id} " in row]
    assert "POST /v1/completions 200" in entry
    assert f"attempts=1 worker_pid={pid} seconds=" in entry
    assert float(entry.rpartition("seconds=")[2].split()[0]) > 0


def test_sigint_first_drains_and_the_drain_timeout_cuts_a_request_short(tmp_path: Path) -> None:
    """SIGINT as the first signal drains like SIGTERM; a request longer than
    drain_timeout_s is cut at the timeout (503 shutting_down) and the daemon exits 0."""
    drain_s = 1.0
    daemon = start_daemon(
        tmp_path, daemon_config(deadline_s=FAR_DEADLINE_S, server={"drain_timeout_s": drain_s})
    )
    # The request must still run when the drain ends, as late as this test accepts that
    # (after wait_busy and the exit bound below), or it answers 200 by itself: with the
    # daemons' 64-token default it was over in 1.3 s, just past the drain when idle.
    daemon.assert_outlasts(LONG_BODY, slack(5.0) + slack(4.0))
    try:
        pids = daemon.worker_pids()
        with concurrent.futures.ThreadPoolExecutor(1) as executor:
            pending = post_completion(executor, daemon, LONG_BODY)
            daemon.wait_busy(1)
            started = time.monotonic()
            daemon.process.send_signal(signal.SIGINT)
            assert daemon.process.wait(30) == 0, daemon.log()[-4000:]
            elapsed = time.monotonic() - started
            response = pending.result()
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "shutting_down"
        assert response.headers["retry-after"]
        assert drain_s <= elapsed < slack(4.0), elapsed  # the drain, not the request
    finally:
        daemon.stop(signal.SIGKILL)
    assert not [pid for pid in pids if pid_alive(pid)]
    assert "SIGINT: draining" in daemon.log()
