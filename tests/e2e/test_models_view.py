"""The loaded-models view of a daemon with [models.NAME] tables, and every table checked
before the port opens: ``modelpool ps`` (name, backend as resolved, state, memory,
workers, idle time, when it unloads), ``modelpool stats`` per model, ``modelpool
generate --url --model``, ``/v1/models`` naming the backend ``auto`` resolved to, and
``serve`` refusing a table whose model does not exist in one line.

The docs, Many models in one daemon.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_support import (
    KEY_ENV,
    Daemon,
    keyed_daemon,
    keyed_http,
    modelpool_command,
    registry_config,
)

from helpers import slack

KEY = "test-models-view-key"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Daemon]:
    models: dict[str, dict[str, Any]] = {
        "chat": {"model": "chat-weights", "preload": True, "pin": True},
        "coder": {"model": "coder-weights", "workers": 1, "ttl_s": 300},
        # Never loaded here: its backend is what serve resolved "auto" to at start.
        "tiny": {"model": str(tiny_model_dir), "backend": "auto", "workers": 1},
    }
    config = registry_config(models, workers=2, server={})
    yield from keyed_daemon(tmp_path_factory.mktemp("models-view"), config, KEY)


@pytest.fixture()
def http(daemon: Daemon) -> Iterator[httpx.Client]:
    with keyed_http(daemon, KEY, timeout=30.0) as client:
        yield client


def cli(*args: str, key: str | None = KEY) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    env.pop(KEY_ENV, None)
    if key is not None:
        env[KEY_ENV] = key
    return subprocess.run(
        [*modelpool_command(), *args, "--api-key-env", KEY_ENV],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def load_coder(http: httpx.Client) -> None:
    answer = http.post("/v1/completions", json={"model": "coder", "prompt": "echo:x"})
    assert answer.status_code == 200, answer.text


def test_ps_shows_each_model_with_its_resolved_backend_memory_and_expiry(
    daemon: Daemon, http: httpx.Client
) -> None:
    load_coder(http)
    listed = cli("ps", "--url", daemon.url, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)}
    assert set(rows) == {"chat", "coder", "tiny"}
    chat, coder, tiny = rows["chat"], rows["coder"], rows["tiny"]
    assert (chat["backend"], chat["state"], chat["workers"]) == ("testing", "loaded", "2/2")
    assert re.fullmatch(r"\d+ MB", chat["memory"]) and chat["unloads"] == "never"
    assert (coder["state"], coder["workers"]) == ("loaded", "1/1")
    # Idle since the answer above: 300 s of ttl_s less that idle time, or in use.
    assert re.fullmatch(r"in (4m( \d+s)?|5m)|5m after use", coder["unloads"]), coder
    assert (tiny["backend"], tiny["state"], tiny["memory"], tiny["workers"]) == (
        "hf",
        "unloaded",
        "-",
        "-",
    )
    table = cli("ps", "--url", daemon.url)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split() == ["NAME", "BACKEND", "STATE", "MEMORY", "WORKERS", "IDLE", "UNLOADS"]
    assert [line.split()[:3] for line in lines] == [
        ["chat", "testing", "loaded"],
        ["coder", "testing", "loaded"],
        ["tiny", "hf", "unloaded"],
    ]


def test_ps_needs_the_key(daemon: Daemon) -> None:
    refused = cli("ps", "--url", daemon.url, key=None)
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr, refused.stderr


def test_v1_models_names_the_backend_auto_resolved_to(http: httpx.Client) -> None:
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert cards["tiny"]["backend"] == "hf" and cards["tiny"]["status"] == "unloaded"
    assert cards["chat"]["backend"] == "testing"


def test_stats_prints_each_model_and_each_loaded_pool(daemon: Daemon, http: httpx.Client) -> None:
    load_coder(http)
    shown = cli("stats", "--url", daemon.url)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    per_model = out[out.index("per model") :]
    for name, state in (("chat", "loaded"), ("coder", "loaded"), ("tiny", "unloaded")):
        assert re.search(rf"\b{name}\b.*\b{state}\b", per_model), out
    # Each loaded model's own pool: its workers listed under its name.
    assert "chat: workers" in out and "coder: workers" in out and "tiny: workers" not in out


def test_generate_url_sends_the_model_named(daemon: Daemon) -> None:
    answered = cli("generate", "echo:from coder", "--url", daemon.url, "--model", "coder")
    assert answered.returncode == 0, answered.stderr
    assert answered.stdout.splitlines()[0] == "from coder"
    unnamed = cli("generate", "echo:x", "--url", daemon.url)
    assert unnamed.returncode == 2
    assert "serves 3 models (chat, coder, tiny): name one with --model NAME" in unnamed.stderr


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            '[models.coder]\nmodel = "{missing}/my-coder"\n',
            r"\[models\.coder\] model directory '.*/my-coder' does not exist",
        ),
        (
            '[models.gguf]\nmodel = "{missing}/coder.gguf"\nbackend = "llama_cpp"\n',
            r"\[models\.gguf\] model '.*/coder\.gguf': GGUF model file .*coder\.gguf' "
            "does not exist",
        ),
    ],
)
def test_a_table_whose_model_does_not_exist_stops_serve_in_one_line(
    tmp_path: Path, table: str, expected: str
) -> None:
    config = tmp_path / "modelpool.toml"
    config.write_text(
        'workers = 1\ndevices = ["cpu"]\n\n[server]\nport = 0\n\n'
        '[models.chat]\nmodel = "chat-weights"\nbackend = "testing"\npreload = true\n\n'
        + table.format(missing=tmp_path / "missing")
    )
    started = subprocess.run(
        [*modelpool_command(), "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=slack(60),
        check=False,
    )
    assert started.returncode == 1, started.stderr
    errors = [line for line in started.stderr.splitlines() if line.startswith("modelpool: ")]
    assert len(errors) == 1 and re.search(expected, errors[0]), started.stderr
    # Refused before any model loaded: the preloaded testing model never started.
    assert "registry ready" not in started.stderr and "Uvicorn running" not in started.stderr
